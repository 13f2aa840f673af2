"""`EpisodeBuffer`: per-env cursors, the two write paths (every env at one slot; envs at different slots),
restarts, growth (all or nothing), and the batched gather into staging memory (yuv420p on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastrecord import pinning, staging
from fastrecord.buffer import BufferTooLargeError, EpisodeBuffer
from fastrecord.staging import locate
from fastrecord.testing import smooth_frames
from fastrecord.video.yuv import YUV420P, Yuv420Frames, rgb_to_yuv420p

N = 3




def data(step: int | list[int], n: int = N) -> dict[str, torch.Tensor]:
    """Rows that say whose they are: obs row e = (e, step of e); frame e filled with 10 * e + step."""
    t = torch.as_tensor(step).expand(n)
    envs = torch.arange(n)
    frames = (10 * envs + t).to(torch.uint8).view(n, 1, 1, 1).expand(n, 4, 4, 3).contiguous()
    return {"obs": torch.stack([envs, t], dim=1).float(), "frames": frames}


def episode(buf: EpisodeBuffer, env: int) -> list[list[float]]:
    """The obs rows of ``env``'s episode in progress (slots 0..cursor)."""
    return buf.fields["obs"][: buf.cursor[env] + 1, env].tolist()


# ---------------------------------------------------------------------------------------------- cursors
def test_start_step_end_move_the_cursors():
    buf = EpisodeBuffer(N, 8)
    assert buf.cursor.tolist() == [-1, -1, -1]  # nothing started
    buf.start(np.arange(N), data(0))
    assert buf.cursor.tolist() == [0, 0, 0]
    assert buf.fields["obs"].shape == (8, N, 2) and buf.fields["frames"].shape == (8, N, 4, 4, 3)  # time-major
    for t in (1, 2):
        buf.step(data(t))
    assert buf.cursor.tolist() == [2, 2, 2]
    assert episode(buf, 1) == [[1, 0], [1, 1], [1, 2]]
    assert buf.fields["frames"][2, 1, 0, 0, 0] == 12
    buf.end(np.array([1]))
    assert buf.cursor.tolist() == [2, -1, 2]


def test_stepping_an_ended_or_unstarted_env_raises():
    buf = EpisodeBuffer(N, 8)
    buf.start(np.array([0, 2]), data(0))  # env 1 never started
    with pytest.raises(RuntimeError, match=r"envs \[1\] whose episode has ended or never started.*env.reset\(\)"):
        buf.step(data(1))
    buf.start(np.array([1]), data(0))
    buf.step(data(1))
    buf.end(np.array([0]))
    with pytest.raises(RuntimeError, match=r"envs \[0\] whose episode has ended"):
        buf.step(data(2))
    assert buf.cursor.tolist() == [-1, 1, 1]  # the failed step moved nothing
    buf.step(data(0), restart=np.array([True, False, False]))  # a fresh reset of env 0 is allowed
    assert buf.cursor.tolist() == [0, 2, 2]


# ---------------------------------------------------------------------------------------------- write paths
def test_envs_at_the_same_slot_and_at_different_slots_write_their_own_rows():
    same = EpisodeBuffer(N, 8)
    same.start(np.arange(N), data(0))
    for t in (1, 2, 3):
        same.step(data(t))  # every env at one slot: one contiguous copy per field

    mixed = EpisodeBuffer(N, 8)
    mixed.start(np.arange(N), data(0))
    mixed.step(data(1))
    mixed.start(np.array([1]), data(0))  # env 1 starts over: cursors [1, 0, 1]
    for k in (1, 2):  # envs at different slots: index_copy_ through per-env slot indices (advanced in place)
        mixed.step(data([1 + k, k, 1 + k]))
    assert mixed.cursor.tolist() == [3, 2, 3]
    for e in (0, 2):
        assert episode(mixed, e) == episode(same, e) == [[e, t] for t in range(4)]
    assert episode(mixed, 1) == [[1, 0], [1, 1], [1, 2]]
    torch.testing.assert_close(mixed.fields["frames"][:3, 1, 0, 0, 0], torch.tensor([10, 11, 12], dtype=torch.uint8))
    mixed.step(data([4, 3, 4]), restart=np.array([False, False, True]))  # env 2 writes slot 0 of a new episode
    assert mixed.cursor.tolist() == [4, 3, 0] and episode(mixed, 2) == [[2, 4]]
    assert episode(mixed, 1) == [[1, t] for t in range(4)]


def test_restart_from_last_moves_the_last_slot_to_slot_0():
    buf = EpisodeBuffer(N, 8)
    buf.start(np.arange(N), data(0))
    for t in (1, 2):
        buf.step(data(t))
    buf.restart_from_last(np.array([0, 2]))
    assert buf.cursor.tolist() == [0, 2, 0]
    assert episode(buf, 0) == [[0, 2]] and episode(buf, 2) == [[2, 2]]
    assert buf.fields["frames"][0, 2, 0, 0, 0] == 22
    buf.step(data([3, 3, 3]))  # different slots from here on
    assert episode(buf, 0) == [[0, 2], [0, 3]] and episode(buf, 1) == [[1, t] for t in range(4)]


def test_envs_at_different_slots_restart_from_their_own_last_slot():
    """One call for envs whose episodes are at different steps (a replay flushing envs that end together after
    starts at different steps): each env's slot 0 gets its own last slot, obs and frames (CPU storages go through
    numpy), and the envs not named keep theirs."""
    buf = EpisodeBuffer(N, 8)
    buf.start(np.arange(N), data(0))
    buf.step(data(1))
    buf.start(np.array([1]), data([0, 7, 0]))  # env 1 starts over: one slot behind from here
    buf.step(data(2))
    buf.step(data(3))
    assert buf.cursor.tolist() == [3, 2, 3]
    buf.restart_from_last(np.array([1, 0]))
    assert buf.cursor.tolist() == [0, 0, 3]
    assert episode(buf, 0) == [[0, 3]] and episode(buf, 1) == [[1, 3]]
    assert buf.fields["frames"][0, 0, 0, 0, 0] == 3 and buf.fields["frames"][0, 1, 0, 0, 0] == 13
    assert episode(buf, 2) == [[2, t] for t in range(4)]


# ---------------------------------------------------------------------------------------------- packed small leaves
def small(step: int | list[int], n: int = N, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Small leaves (a pack per dtype) whose rows say whose they are: env e at step t."""
    t = torch.as_tensor(step).expand(n)
    e = torch.arange(n)
    return {
        "actions": torch.stack([e, t, -t], dim=1).to(dtype),
        "rewards": (10 * e + t).to(dtype),
        "obs/pose": (100 * e + t).view(n, 1, 1).to(dtype) + torch.arange(12, dtype=dtype).view(1, 3, 4),
        "terminated": t % 2 == 1,
        "success": e == t,
        "frames": (10 * e + t).to(torch.uint8).view(n, 1, 1, 1).expand(n, 4, 4, 3),
    }


def rows_of(buf: EpisodeBuffer, env: int, steps: list[int], dtype: torch.dtype) -> None:
    """Every field of ``env`` holds ``small(step)``'s row of that env in slots ``0..len(steps) - 1``."""
    for name in ("actions", "rewards", "obs/pose", "terminated", "success", "frames"):
        want = torch.stack([small(t, dtype=dtype)[name][env] for t in steps])
        torch.testing.assert_close(buf.fields[name][: len(steps), env], want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: no numpy dtype, torch's write path
def test_small_leaves_share_a_storage_and_keep_their_rows(dtype):
    buf = EpisodeBuffer(N, 3)
    buf.start(np.arange(N), small(0, dtype=dtype))
    f = buf.fields
    assert f["actions"].shape == (3, N, 3) and f["rewards"].shape == (3, N) and f["obs/pose"].shape == (3, N, 3, 4)
    assert f["terminated"].shape == f["success"].shape == (3, N) and f["success"].dtype == torch.bool
    # one storage for the small leaves of a dtype (one write a step), images apart
    ptr = {n: f[n].untyped_storage().data_ptr() for n in f}
    assert ptr["actions"] == ptr["rewards"] == ptr["obs/pose"] and ptr["terminated"] == ptr["success"]
    assert len(set(ptr.values())) == 3
    buf.step(small(1, dtype=dtype))  # every env at one slot
    buf.start(np.array([1]), small(0, dtype=dtype))  # env 1 anew: envs at different slots
    buf.step(small([2, 1, 2], dtype=dtype))
    buf.step(small([3, 2, 3], dtype=dtype))  # past the capacity: grown
    assert buf.capacity == 6
    assert buf.cursor.tolist() == [3, 2, 3]
    rows_of(buf, 0, [0, 1, 2, 3], dtype)
    rows_of(buf, 1, [0, 1, 2], dtype)
    buf.step(small([4, 3, 0], dtype=dtype), restart=np.array([False, False, True]))
    rows_of(buf, 2, [0], dtype)
    rows_of(buf, 1, [0, 1, 2, 3], dtype)
    partial = small([5, 4, 1], dtype=dtype)
    del partial["success"]  # a step without one member: the others are written leaf by leaf
    buf.step(partial)
    assert buf.cursor.tolist() == [5, 4, 1]
    rows_of(buf, 0, [0, 1, 2, 3, 4], dtype)  # slots 0..4 as before
    assert buf.fields["actions"][5, 0].tolist() == [0, 5, -5] and buf.fields["rewards"][4, 1].item() == 14
    buf.restart_from_last(np.array([0]))
    assert buf.fields["obs/pose"][0, 0].tolist() == small(5, dtype=dtype)["obs/pose"][0].tolist()
    if dtype is torch.bfloat16:
        return  # the reads below hand out numpy arrays, which have no bfloat16
    # the reads at episode ends see the same rows
    got = buf.read_rows(np.array([1, 2]), last=["actions", "terminated"], whole=["rewards"])
    assert got["actions"].tolist() == [[1, 4, -4], [2, 1, -1]] and got["terminated"].tolist() == [False, True]
    assert got["whole/rewards"][1, :2].tolist() == [20, 21]
    out = buf.gather(np.array([2, 1]))
    assert (
        out["obs/pose"].shape == (2, 5, 3, 4)
        and out["obs/pose"][1, 4].tolist() == small(4, dtype=dtype)["obs/pose"][1].tolist()
    )


def test_a_packed_leaf_that_changes_shape_at_a_full_reset_gets_its_own_storage():
    buf = EpisodeBuffer(N, 4)
    buf.start(np.arange(N), small(0))
    buf.step(small(1))
    with pytest.raises(ValueError, match=r"recorded field 'actions' changed from \[3\] torch.float32 to \[2\]"):
        buf.step({**small(2), "actions": torch.zeros(N, 2)})
    bigger = {**small(0), "obs/pose": torch.ones(N, 5)}
    buf.start(np.arange(N), bigger)  # a reconfiguring full reset: every cursor is at 0
    assert buf.fields["obs/pose"].shape == (4, N, 5)
    buf.step({**small(1), "obs/pose": torch.full((N, 5), 2.0)})
    assert buf.fields["obs/pose"][:2, 2].tolist() == [[1.0] * 5, [2.0] * 5]
    assert buf.fields["actions"][1, 2].tolist() == [2, 1, -1] and buf.fields["rewards"][1, 2].item() == 21


# ---------------------------------------------------------------------------------------------- growth
def test_growth_keeps_contents():
    buf = EpisodeBuffer(N, 2)
    buf.start(np.arange(N), data(0))
    buf.step(data(1))
    buf.start(np.array([1]), data(0))  # envs at different slots across the growth
    for t in (2, 3, 4):
        buf.step(data([t, t - 1, t]))
    assert buf.capacity == 8  # doubled twice: 2 -> 4 -> 8
    assert buf.fields["obs"].shape[0] == buf.fields["frames"].shape[0] == 8
    assert episode(buf, 0) == [[0, t] for t in range(5)]
    assert episode(buf, 1) == [[1, t] for t in range(4)]
    torch.testing.assert_close(buf.fields["frames"][:5, 2, 0, 0, 0], torch.arange(20, 25, dtype=torch.uint8))


def test_growth_that_cannot_fit_raises_and_changes_nothing(monkeypatch):
    buf = EpisodeBuffer(N, 3)
    buf.start(np.arange(N), data(0))
    buf.step(data(1))
    buf.step(data(2))  # full: the next step needs a larger buffer
    before = {k: v.clone() for k, v in buf.fields.items()}
    cursor = buf.cursor.copy()
    monkeypatch.setattr("fastrecord.buffer.free_bytes", lambda device: 0)
    with pytest.raises(BufferTooLargeError, match=r"needs [\d.]+ GiB on cpu \(3 envs x 6 steps x .*buffer_capacity"):
        buf.step(data(3))
    assert buf.capacity == 3 and buf.cursor.tolist() == cursor.tolist()
    for k, v in buf.fields.items():
        assert v.shape == before[k].shape
        torch.testing.assert_close(v, before[k])
    monkeypatch.undo()  # memory again: the episodes go on where they were
    buf.step(data(3))
    assert episode(buf, 2) == [[2, t] for t in range(4)]


# ---------------------------------------------------------------------------------------------- gather
def _filled_buffer(n: int = 3, steps: int = 4, size: int = 32) -> tuple[EpisodeBuffer, torch.Tensor]:
    buf = EpisodeBuffer(n, steps + 1)
    frames = torch.from_numpy(np.stack([smooth_frames(steps + 1, size, size, seed=e) for e in range(n)]))
    big = torch.arange(n * 40000, dtype=torch.float32).reshape(n, 40000)  # pushes the gather past 1 MiB
    buf.start(np.arange(n), {"frames": frames[:, 0], "obs/big": big})
    for t in range(1, steps + 1):
        buf.step({"frames": frames[:, t], "obs/big": big + t})
    return buf, frames


def test_gather_returns_buffer_contents_in_staging_memory():
    buf, frames = _filled_buffer()
    out = buf.gather(np.array([2, 0]))
    np.testing.assert_array_equal(out["frames"], frames.numpy()[[2, 0]])
    assert out["obs/big"][0, 3, 0] == 2 * 40000 + 3
    if staging.shared_memory_supported():
        assert locate(out["frames"][1]) is not None  # encoder processes read it in place
    # transforms run on CUDA buffers: on a CPU buffer the frames stay RGB
    plain = buf.gather(np.arange(3), transforms={"frames": YUV420P})["frames"]
    assert not isinstance(plain, Yuv420Frames) and plain.shape == (3, 5, 32, 32, 3)


def test_gather_small_fields_skip_staging():
    buf = EpisodeBuffer(2, 3)
    buf.start(np.arange(2), {"success": torch.zeros(2, dtype=torch.bool)})
    buf.step({"success": torch.tensor([True, False])})
    out = buf.gather(np.arange(2), names=["success"])
    assert out["success"][:, 1].tolist() == [True, False] and locate(out["success"]) is None


@pytest.mark.gpu
def test_gather_yuv420p_on_cuda_matches_cpu_conversion():
    _, frames = _filled_buffer()
    big = torch.zeros(3, 200000, device="cuda")  # pushes the gather past the staging threshold
    gpu = EpisodeBuffer(3, 5)
    gpu.start(np.arange(3), {"frames": frames[:, 0].cuda(), "obs/big": big})
    for t in range(1, 5):
        gpu.step({"frames": frames[:, t].cuda(), "obs/big": big})
    out = gpu.gather(np.array([1, 2]), transforms={"frames": YUV420P})["frames"]
    assert isinstance(out, Yuv420Frames) and out.frame_size == (32, 32)
    out.wait_ready()
    diff = np.abs(out.view(np.ndarray).astype(int) - rgb_to_yuv420p(frames[[1, 2]]).numpy())
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # float rounding between the kernels
    # the names-only form of callers not moved to transforms= gives the same
    same = gpu.gather(np.array([1, 2]), transforms={"frames": YUV420P})["frames"]
    same.wait_ready()
    np.testing.assert_array_equal(same.view(np.ndarray), out.view(np.ndarray))


@pytest.mark.gpu
def test_a_gather_into_an_arena_still_being_pinned_lands_in_every_piece(monkeypatch):
    """A fresh process's first gathers: the arena is leased while its pieces are still being pinned (here 256 KiB
    pieces, each held back 5 ms); each copy goes into one piece once it is pinned (a copy across two registrations
    is refused by CUDA), the converted frames' on the pinning thread. Every value lands, and each episode's frames
    can be waited for on their own."""
    import time

    monkeypatch.setattr(staging, "PIN_PIECE", 256 * 1024)
    register = pinning.register
    monkeypatch.setattr(pinning, "register", lambda b, t=None: (time.sleep(0.005), register(b, 1))[1])
    pool = staging.StagingPool()
    monkeypatch.setattr(staging, "_default_pool", pool)
    n, steps, size = 6, 5, 96
    frames = torch.from_numpy(np.stack([smooth_frames(steps + 1, size, size, seed=e) for e in range(n)])).cuda()
    big = torch.arange(n * 300000, dtype=torch.float32, device="cuda").reshape(n, 300000)  # 7 MiB, plain
    buf = EpisodeBuffer(n, steps + 1)
    buf.start(np.arange(n), {"frames": frames[:, 0], "obs/big": big})
    for t in range(1, steps + 1):
        buf.step({"frames": frames[:, t], "obs/big": big + t})
    rows = np.array([4, 1, 5, 0])
    out = buf.gather(rows, transforms={"frames": YUV420P})
    arena = locate(out["obs/big"])[0]
    assert arena.size > 8 * staging.PIN_PIECE  # many pieces
    want_big = torch.stack([big + t for t in range(steps + 1)], 1)[torch.as_tensor(rows)].cpu().numpy()
    np.testing.assert_array_equal(out["obs/big"], want_big)  # plain fields: ready on return
    yuv = out["frames"]
    want = rgb_to_yuv420p(frames[torch.as_tensor(rows)].cpu()).numpy()
    for i in range(len(rows)):  # one episode at a time, as the encoders wait
        one = yuv[i]
        one.wait_ready()
        diff = np.abs(one.view(np.ndarray).astype(int) - want[i])
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # float rounding between the kernels
    arena.wait_pinned(arena.size)
    assert arena.pinned and not arena.pinning
    del out, yuv, one
    pool.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_read_rows_reads_last_slots_whole_episodes_and_extras_at_once(device):
    """The episode-end flags (last slot, whole episode) and extra tensors in one transfer: the values of
    the buffer, for envs at different slots, in the order asked."""
    n = 3
    buf = EpisodeBuffer(n, 4)
    flags = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    buf.start(np.arange(n), {"success": flags(False, False, False), "reward": torch.zeros(n, device=device)})
    buf.step({"success": flags(False, True, False), "reward": torch.tensor([1.0, 2.0, 3.0], device=device)})
    buf.start(
        np.array([1]), {"success": flags(False, False, False), "reward": torch.zeros(n, device=device)}
    )  # env 1 anew
    buf.step({"success": flags(True, True, False), "reward": torch.tensor([4.0, 5.0, 6.0], device=device)})
    returns = torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64, device=device)
    got = buf.read_rows(np.array([2, 0, 1]), last=["success", "reward", "absent"], whole=["success"],
                        extra={"returns": returns[[2, 0, 1]]})
    assert sorted(got) == ["returns", "reward", "success", "whole/success"]
    assert got["success"].tolist() == [False, True, True] and got["reward"].tolist() == [6.0, 4.0, 5.0]
    assert got["whole/success"].shape == (3, 3)  # slots 0..max cursor (2); env 1 is at slot 1
    assert got["whole/success"][:, :2].tolist() == [[False, False], [False, False], [False, True]]
    assert got["whole/success"][:2, 2].tolist() == [False, True]
    assert got["returns"].tolist() == [30.0, 10.0, 20.0] and all(isinstance(v, np.ndarray) for v in got.values())
