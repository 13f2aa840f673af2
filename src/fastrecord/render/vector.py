"""`GroupRenderedVectorEnv`: a gymnasium vector env of CPU-simulated ManiSkill envs whose ``render()`` is
one batched render, in this process, of every env's human camera.

The sub-envs (in their own processes, stepping in parallel) are wrapped in `PoseReporter`: each step and
reset hands back, in its info, the poses of the scene's moving entities (``[B, 7]`` float32, about 0.5 KB
an env) and, when the sub-env's scene is new (a reconfiguring reset), what the scene looks like and the
episode seed it was built from. This process holds one mirror env per sub-env: when a reported scene
looks different from the mirror's, the mirror is reset to the same episode seed with
``reconfigure=True`` (ManiSkill builds a scene from its episode seed alone), and the signatures must then
agree. ``render()`` writes every env's poses into the group's CUDA pose tensor and takes one picture per
camera name (`fastrecord.render.group.GroupRenderer`).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from fastrecord.envs import SubEnvAccess, to_numpy
from fastrecord.render import BatchedRenderError
from fastrecord.render import device as early_device
from fastrecord.render.bodies import RenderBodies
from fastrecord.render.device import device_of
from fastrecord.render.group import GroupRenderer
from fastrecord.reported import InfoReporter
from fastrecord.system import stamp

INFO_KEY = "fastrecord_render"  # the sub-envs' report in the vector info (gymnasium adds the mask "_" + key)


class PoseReporter(InfoReporter):
    """Wraps one CPU sub-env (outermost, in its own process): every step's and reset's info carries
    ``(poses, scene)`` under `INFO_KEY`; ``scene`` is None unless the scene is new since the last report,
    then ``(signature, episode_seed)``."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self._bodies = RenderBodies(self.env.unwrapped)
        self._bodies.signature()  # warmed here, with the env's make: see `RenderBodies.signature`
        self._reported = False  # the first report carries the scene, new or not

    def _report(self, info: dict[str, Any]) -> dict[str, Any]:
        base: Any = self.env.unwrapped  # a ManiSkill env
        new = self._bodies.refresh() or not self._reported
        self._reported = True
        scene: tuple[tuple[Any, ...], int] | None = None
        if new:
            seed = int(np.asarray(base._episode_seed).reshape(-1)[0])
            scene = (self._bodies.signature(), seed)
        info = dict(info)
        info[INFO_KEY] = (self._bodies.poses(), scene)  # a tuple: gymnasium keeps it as one object per env
        return info

    def get_state(self) -> np.ndarray:
        """The env's flat state (ManiSkill's ``get_state``) as numpy: the recorder asks every sub-env for it each
        step, and a torch tensor leaves an AsyncVectorEnv worker through torch's shared-memory hand-off (a file
        descriptor sent over a socket per tensor), numpy in the pickle (a 96-episode replay loop on the H200:
        13.9 -> 10.1 s)."""
        base: Any = self.env.unwrapped  # a ManiSkill env
        return to_numpy(base.get_state())


_freezing = threading.Lock()
_frozen_depth = 0  # scenes_built uses inside (any thread) that share this process's one freeze


@contextlib.contextmanager
def scenes_built(collect: bool = False) -> Iterator[None]:
    """Inside: ManiSkill's ``gc.collect()`` at every scene build (env creation, a reconfiguring reset) walks
    only the objects made inside, not the process's older ones (frozen for the while: ``gc.freeze``);
    leaving undoes the freeze (``gc.unfreeze``), then, with ``collect``, collects once (the scenes the builds
    replaced). Measured on the H200 machine: a PickCube mirror 0.16 s, 0.13 s of it in that collection,
    0.03 s inside; 16 mirrors 0.5 s. Nested and concurrent uses (the mirrors' thread beside the caller's
    vector env building gymnasium's dummy env) share one freeze: the last to leave undoes it (and with it any
    freeze of another library's before: ``gc.unfreeze`` has no other kind; it only puts objects back in the
    collector's reach). Where fastrecord froze the process's imports for good (its own processes:
    `fastrecord.workers.freeze_imports`) those collections are cheap already and the freeze is left alone. Not
    decided by ``gc.get_freeze_count()``: in the baseline eval on the H100 machine (Python 3.12, 2026-12-06) 375
    objects were frozen by some other library, and with that rule the 16 mirrors' collections walked all 324,000
    objects, 160-270 ms each (3.1 s of the mirrors' 3.9 s)."""
    from fastrecord.workers import imports_frozen

    global _frozen_depth
    collect_pending()  # scenes closed with their collection left for later: freed before new ones are built
    with _freezing:
        if _frozen_depth == 0 and imports_frozen():
            ours = False  # frozen for good by the process
        else:
            ours = True
            if _frozen_depth == 0:
                gc.freeze()
            _frozen_depth += 1
    if not ours:
        yield
        return
    try:
        yield
    finally:
        with _freezing:
            _frozen_depth -= 1
            last = _frozen_depth == 0
            if last:
                gc.unfreeze()
        if last and collect:
            gc.collect()


class _DeferredGC:
    """Stands in for the ``gc`` module in ManiSkill's env module (`collections_deferred`): ``collect`` notes
    that a collection was asked for; everything else is the gc module's."""

    asked = False

    def __getattr__(self, name: str) -> Any:
        return getattr(gc, name)

    def collect(self, *args: Any, **kwargs: Any) -> int:
        _DeferredGC.asked = True
        return 0


_deferring = threading.Lock()
_deferred_depth = 0
_collection_pending = False  # a `collections_deferred(later=True)` left its collection to the next scene build


def collect_pending() -> None:
    """Run the collection a `collections_deferred(later=True)` left (the closed scenes' GPU memory), if any: before
    this process builds scenes again (`scenes_built`)."""
    global _collection_pending
    with _deferring:
        pending, _collection_pending = _collection_pending, False
    if pending:
        gc.collect()


@contextlib.contextmanager
def collections_deferred(later: bool = False) -> Iterator[None]:
    """Inside: the full collection ManiSkill runs at the close of every env (``BaseEnv._clear``: ``gc.collect()``,
    to release GPU memory) is deferred; leaving runs one collection where any was asked for. Closing N envs in
    one process then walks the heap once instead of N times (0.1-0.3 s a walk once torch and ManiSkill are
    imported). ``later``: leaving does not collect either; the collection runs before this process next builds a
    scene through fastrecord (`collect_pending`, from `scenes_built`), and any ManiSkill env made meanwhile runs its
    own at its creation (``_clear``), so the closed scenes' GPU memory is freed before new scenes take theirs; until
    then Python's own collections free it. The batched render's close takes that (its final collection was 0.25 s
    of a 0.77 s close, on the H100 machine). Only ManiSkill's env module sees the stand-in (its ``gc`` name), for
    the while; nested and concurrent uses share one deferral, and the last to leave collects. Where ManiSkill's env
    module has no ``gc`` name (another version), nothing is deferred."""
    global _deferred_depth, _collection_pending
    from mani_skill.envs import sapien_env

    with _deferring:
        usable = _deferred_depth > 0 or getattr(sapien_env, "gc", None) is gc
        if usable:
            if _deferred_depth == 0:
                sapien_env.gc = _DeferredGC()
            _deferred_depth += 1
    if not usable:
        yield
        return
    try:
        yield
    finally:
        with _deferring:
            _deferred_depth -= 1
            last = _deferred_depth == 0
            asked = last and _DeferredGC.asked
            if last:
                sapien_env.gc = gc
                _DeferredGC.asked = False
            if asked and later:
                _collection_pending, asked = True, False
        if asked:
            gc.collect()


def _human_camera_names(base: Any) -> list[str]:
    return list(base.scene.human_render_cameras)


class GroupRenderedVectorEnv(SubEnvAccess, gym.vector.VectorWrapper):
    """Batched rendering over a vector env whose sub-envs are wrapped in `PoseReporter`.

    Owns: the mirror envs (one per sub-env, never stepped), their `GroupRenderer`, and the poses of the
    last step or reset. ``render()`` returns ``[num_envs, H, W, 3]`` uint8 on the mirrors' CUDA device,
    the pictures ManiSkill's ``render()`` of each sub-env would give (several human cameras: tiled side by
    side, as ManiSkill tiles them).
    """

    renders_batched = True  # fastrecord's VectorEnvView calls render() once instead of call("render")
    resets_async = True  # reset_async / reset_wait (RecordVectorEpisode's reset takes the ended episodes between)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that changes ``reset`` but not ``reset_wait`` resets whole only (its ``reset`` is the one)."""
        super().__init_subclass__(**kwargs)
        if "reset" in cls.__dict__ and "reset_wait" not in cls.__dict__:
            cls.resets_async = False
    # close() ends the sub-env processes at once (``AsyncVectorEnv.close(terminate=True)``) instead of asking each
    # to close its env: only where the sub-envs hold nothing to save (`fastrecord record`'s own, which simulate
    # and report poses; the recording is all in this process). make_eval_envs' sub-envs run the caller's wrappers
    # and close in order.
    terminate_subenvs = False

    def __init__(self, env: gym.vector.VectorEnv, make_mirror: Callable[[], gym.Env] | None = None,
                 device: str = "cuda", mirrors: list[gym.Env] | None = None,
                 renderer: GroupRenderer | None = None) -> None:
        super().__init__(env)
        if mirrors is None:
            if make_mirror is None:
                raise ValueError(
                    "GroupRenderedVectorEnv needs make_mirror (a function making one mirror env) or mirrors"
                )
            with scenes_built():
                mirrors = [make_mirror() for _ in range(env.num_envs)]
        if len(mirrors) != env.num_envs:
            raise ValueError(f"{len(mirrors)} mirrors for {env.num_envs} sub-envs; pass one mirror per sub-env")
        self.mirrors = mirrors
        if renderer is not None and renderer.envs != [m.unwrapped for m in mirrors]:
            raise ValueError("the renderer draws other envs than the mirrors; pass the GroupRenderer of these mirrors")
        self.renderer = renderer or GroupRenderer(self.mirrors, device=device)
        self._signatures = [b.signature() for b in self.renderer.bodies]
        self._poses: list[np.ndarray | None] = [None] * env.num_envs
        self.mirror_rebuilds = 0  # mirrors reset to a reported seed because their scene looked different
        self._reset_done: tuple[Any, dict[str, Any]] | None = None  # reset_async's whole reset, where it ran whole

    @staticmethod
    def warm_cameras(base: Any) -> list[str]:
        """The cameras whose first picture `group_rendered` draws ahead: what ``render()`` draws (the human ones)."""
        return _human_camera_names(base)

    def _take(self, info: dict) -> dict:
        if INFO_KEY not in info:
            raise RuntimeError(f"the sub-envs did not report their poses ({INFO_KEY!r} missing from the step's info): "
                               f"wrap each sub-env in fastrecord.render.vector.PoseReporter")
        info = dict(info)
        reports = info.pop(INFO_KEY)
        mask = info.pop("_" + INFO_KEY, np.ones(self.num_envs, dtype=bool))
        new = [(int(i), reports[i][1]) for i in np.flatnonzero(mask) if reports[i][1] is not None]
        if any(scene[0] != self._signatures[i] for i, scene in new):
            with scenes_built(collect=True):  # one collection for all the mirrors rebuilt
                for i, scene in new:
                    self._sync(i, *scene)
        for j in np.flatnonzero(mask):
            self._poses[j] = reports[j][0]
        return info

    def _sync(self, i: int, signature: tuple, seed: int) -> None:
        if signature == self._signatures[i]:
            return
        self.mirrors[i].reset(seed=seed, options={"reconfigure": True})
        bodies = self.renderer.bodies[i]
        bodies.refresh()
        mine = bodies.signature()
        if mine != signature:
            raise BatchedRenderError(
                f"sub-env {i}'s scene (episode seed {seed}) could not be rebuilt in the rendering process: "
                f"the same env reset with seed {seed} and reconfigure=True looks different (its scene is "
                f"not a function of its episode seed). Render each env in its own process instead "
                f"(make_eval_envs(batched_render=False), fastrecord record --batched-render off)"
            )
        self._signatures[i] = mine
        self.renderer.invalidate()
        self.mirror_rebuilds += 1

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        return obs, self._take(info)

    def reset_async(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> None:
        """`reset` in two halves where the sub-envs' vector env has them (`fastrecord.packed.PackedVectorEnv`):
        the sub-envs reset while the caller goes on; `reset_wait` takes their answers (and syncs the mirrors).
        Elsewhere the reset runs here whole and `reset_wait` returns it."""
        from fastrecord.packed import PackedVectorEnv

        if isinstance(self.env, PackedVectorEnv):
            self.env.reset_async(seed=seed, options=options)
            self._reset_done = None
        else:
            self._reset_done = self.env.reset(seed=seed, options=options)

    def reset_wait(self) -> tuple[Any, dict[str, Any]]:
        done, self._reset_done = self._reset_done, None
        obs, info = done if done is not None else self.env.reset_wait()
        return obs, self._take(info)

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, rew, terminated, truncated, info = self.env.step(actions)
        return obs, rew, terminated, truncated, self._take(info)

    def _reported_poses(self, what: str) -> list[np.ndarray]:
        """Every sub-env's last reported poses; ``what`` (a render, a step) before the first reset is an error."""
        poses = [p for p in self._poses if p is not None]
        if len(poses) != len(self._poses):
            raise RuntimeError(f"{what} before reset(): reset the envs first")
        return poses

    def render(self) -> torch.Tensor:  # type: ignore[override]  # batched tensors, as ManiSkill's BaseEnv.render
        self.renderer.set_poses(self._reported_poses("render()"))
        names = _human_camera_names(self.renderer.envs[0])
        frames = [self.renderer.render(name) for name in names]
        if len(frames) == 1:
            return frames[0]
        return torch.cat(frames, dim=2)  # side by side, each env's cameras in a row

    def close(self, **kwargs: Any) -> None:
        """Close the sub-envs (in their processes) and the mirrors (here) at the same time, ManiSkill's full
        collection at each mirror's close deferred to one before this process next builds scenes
        (`collections_deferred` with ``later``: a collection walks this process's heap, 0.13 s at a mirror's build
        on the H200 machine, 0.25 s at this close on the H100). An error of either side is raised after both are
        closed (the sub-envs' first)."""
        failed: list[BaseException] = []

        if self.terminate_subenvs:
            kwargs.setdefault("terminate", True)

        def close_subenvs() -> None:
            try:
                self.env.close(**kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller below
                failed.append(e)
            stamp("subenvs_closed")

        with collections_deferred(later=True):
            thread = threading.Thread(target=close_subenvs, name="fastrecord-close-subenvs", daemon=True)
            thread.start()
            try:
                for m in self.mirrors:
                    m.close()
                self.mirrors = []
                stamp("mirrors_closed")
            finally:
                thread.join()
        stamp("batched_render_closed")
        if failed:
            raise failed[0]


def mirror_kwargs(env_kwargs: dict, render_backend: str | None = None) -> dict:
    """``gym.make`` kwargs of a mirror of a sub-env made with ``env_kwargs``: the same scene, simulated on
    the CPU (never stepped), state observations (it renders no sensors for observations), rendering on the
    CUDA device."""
    kw = dict(env_kwargs)
    kw.update(sim_backend="physx_cpu", obs_mode="state", render_mode="rgb_array")
    kw["render_backend"] = device_of(render_backend or kw.get("render_backend"))
    kw.pop("num_envs", None)
    return kw


def make_mirror_factory(env_id: str, env_kwargs: dict, render_backend: str | None = None) -> Callable[[], gym.Env]:
    kw = mirror_kwargs(env_kwargs, render_backend)

    def make() -> gym.Env:
        import mani_skill.envs  # noqa: F401 - registers the tasks

        return gym.make(env_id, **kw)

    return make


def group_rendered(make_envs: Callable[[], gym.vector.VectorEnv], make_mirror: Callable[[], gym.Env], num_envs: int,
                   device: str = "cuda", cls: type[GroupRenderedVectorEnv] | None = None) -> GroupRenderedVectorEnv:
    """``make_envs()`` (a vector env of `PoseReporter` sub-envs) under a `GroupRenderedVectorEnv`, its
    mirrors made in a thread meanwhile: the sub-envs start in processes of their own while this process
    waits for them, so the mirrors cost no extra start-up time (16 PickCube mirrors: 0.5 s with
    `scenes_built`, 2.6 s without, measured on the H200 machine; the first also starts the renderer, 0.85 s).
    The same thread then makes the mirrors' `GroupRenderer` and warms it (`GroupRenderer.warm`: the group, the
    human cameras' camera groups, one picture each), which the first reset's render would otherwise wait for; a
    warm-up that fails is dropped (the first render builds the same things, and raises what it must). ``cls``: the
    vector env made of both (a `GroupRenderedVectorEnv`, the default, or a subclass), which also names the cameras
    to warm (``warm_cameras``)."""
    cls = cls or GroupRenderedVectorEnv
    mirrors: list[gym.Env] = []
    renderers: list[GroupRenderer] = []
    failed: list[BaseException] = []

    def build() -> None:
        stamp("mirrors_started")
        try:
            early_device.settle_early(device)  # the engine opened early (`fastrecord.render.device`), if on this device
            with scenes_built():
                for _ in range(num_envs):
                    mirrors.append(make_mirror())
                    stamp("first_mirror_built")
            stamp("mirrors_built")
            early_device.release_early()  # the mirrors' scenes hold the engine now
            renderer = GroupRenderer(mirrors, device=device)
            renderers.append(renderer)
            for bodies in renderer.bodies:  # warmed here, not in the caller's thread: see `RenderBodies.signature`
                bodies.signature()
            try:
                renderer.warm(cls.warm_cameras(renderer.envs[0]))
                stamp("group_warmed")
            except Exception:  # noqa: BLE001 - an optimisation only: the first render does it again
                renderer.invalidate()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller below
            failed.append(e)

    thread = threading.Thread(target=build, name="fastrecord-mirrors", daemon=True)
    thread.start()
    envs = None
    try:
        envs = make_envs()
        stamp("subenvs_ready")
    finally:
        thread.join()
        if envs is None or failed:  # nothing is left open when either side failed
            for m in mirrors:
                m.close()
            if envs is not None:
                envs.close()
    if failed:
        raise failed[0]
    try:
        return cls(envs, device=device, mirrors=mirrors, renderer=renderers[0])
    except BaseException:
        envs.close()
        for m in mirrors:
            m.close()
        raise
