"""Views that read any supported env as batched tensors, so the recorder has one code path.

`EnvView` is what the recorder (and the sharded loop) needs of an env; every difference between env kinds
lives in a view. `ManiSkillView` reads a ManiSkill env (``num_envs >= 1``: GPU-parallel or a single CPU
env, the latter possibly under ``CPUGymWrapper``); `VectorEnvView` reads a gymnasium vector env of
ManiSkill CPU envs (Sync or Async), turning its tuples of per-env results into batched tensors. A new env
kind is a new view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import gymnasium as gym
import numpy as np
import torch
from mani_skill.envs.sapien_env import BaseEnv
from mani_skill.utils import gym_utils
from mani_skill.utils.wrappers import CPUGymWrapper
from mani_skill.utils.wrappers.record import parse_env_info

from fastrecord.buffer import flatten_tree
from fastrecord.render import lut
from fastrecord.substeps import SWITCH, TAKE, SubstepCapture, step_frames

IMAGE_RENDER_MODES = ("rgb_array", "sensors", "all")


def to_batched(x: Any, device: torch.device | None, add_batch_dim: bool) -> Any:
    """Tree of arrays/tensors/scalars -> tree of tensors with a leading env dim, on ``device`` (None: where
    they are; arrays and scalars on the CPU)."""
    if isinstance(
        x, torch.Tensor
    ):  # first: every step batches the observation's leaves (a Mapping test is an ABC check)
        t = x
    elif isinstance(x, Mapping):
        return {k: to_batched(v, device, add_batch_dim) for k, v in x.items()}
    else:
        t = torch.as_tensor(np.asarray(x))
    if add_batch_dim or t.ndim == 0:
        t = t[None]
    return t if device is None else t.to(device, non_blocking=True)


def unbatchable(value: Any, path: str) -> TypeError:
    """The error for a tree `to_batched` refused: it names the first leaf that is not numbers (an array of Python
    objects, e.g. the torch tensors of a ManiSkill env's info gathered by a gymnasium vector env) and the fix."""
    where, item = path, None
    for name, leaf in flatten_tree(value, path).items():
        a = None if isinstance(leaf, torch.Tensor) else np.asarray(leaf)
        if a is not None and a.dtype.kind in "OUSV":  # objects, strings, bytes, raw records
            where, item = name, a.flat[0] if a.size else None
            break
    return TypeError(f"the env's {where!r} holds {type(item).__name__} objects, not numbers, and a recorder stores "
                     f"arrays of numbers; a gymnasium vector env of ManiSkill envs gathers their torch tensors that "
                     f"way: wrap each sub-env in mani_skill.utils.wrappers.CPUGymWrapper (numpy values of one env, "
                     f"as ManiSkill's make_eval_envs does), or on GPU simulation pass the ManiSkill env itself "
                     f"(num_envs=N)")


def cat_trees(trees: list[Any]) -> Any:
    """Concatenate per-env trees of [1, ...] tensors along dim 0."""
    first = trees[0]
    if isinstance(first, Mapping):
        return {k: cat_trees([t[k] for t in trees]) for k in first}
    return torch.cat([torch.as_tensor(t) for t in trees], dim=0)


def to_numpy(x: Any) -> np.ndarray:
    """``x`` (a tensor on any device, an array or a scalar) as a numpy array."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class SubEnvAccess:
    """Mixin for ``gym.vector.VectorWrapper`` subclasses: forwards ``call``/``get_attr``/``set_attr`` to
    the vector env at the bottom, which gymnasium's ``VectorWrapper`` does not do, or to the first wrapper on
    the way down that answers some calls itself (``answers_calls = True``: it forwards the rest)."""

    env: Any
    answers_calls = False

    def _answering(self) -> Any:
        env = self.env
        while isinstance(env, gym.vector.VectorWrapper) and not getattr(env, "answers_calls", False):
            env = env.env
        return env

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return self._answering().call(name, *args, **kwargs)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        return self._answering().get_attr(name)

    def set_attr(self, name: str, values: Any) -> None:
        self._answering().set_attr(name, values)


def simulation_processes(env: Any) -> int:
    """How many processes of its own ``env`` steps in: a vector env's sub-env processes (gymnasium's
    ``AsyncVectorEnv``, `fastrecord.packed.PackedVectorEnv`: their ``processes``), found through its wrappers
    (``env.env``); 0 where the envs step in this process."""
    for _ in range(64):  # a wrapper chain, not a cycle
        own = vars(env) if hasattr(env, "__dict__") else {}
        procs = own.get("processes")
        if isinstance(procs, list):
            return len(procs)
        env = own.get("env")
        if env is None:
            return 0
    return 0


@runtime_checkable
class EnvView(Protocol):
    """What the recorder reads from an env, batched: every leaf has a leading dim of ``num_envs``."""

    env: Any  # the env read: a ManiSkill env's wrapper chain, or a gymnasium VectorEnv
    num_envs: int
    device: torch.device
    unbatched: bool  # the env takes and returns single-env values (no env dim): the view adds it
    render_mode: str | None
    single_action_space: Any

    @property
    def per_env_seeds(self) -> bool:
        """Each env's episode has its own seed (its reset kwargs say ``seed=<that env's seed>``); False: one
        env, whose reset kwargs are kept as the caller gave them (ManiSkill's JSON)."""
        ...

    @property
    def control_mode(self) -> str | None: ...

    def batch(self, x: Any) -> Any:
        """A tree of per-step values as tensors with the env dim (on the device they come from)."""
        ...

    def render(self) -> Any:
        """Every env's frame: ``[num_envs, H, W, 3]``."""
        ...

    def state_dict(self, refresh: bool = False) -> dict: ...

    def episode_seeds(self) -> np.ndarray:
        """The seed of each env's current episode, ``[num_envs]`` (or ``[1]`` for one shared seed)."""
        ...

    def partial_reset_options(self, env_idx: Sequence[int] | np.ndarray) -> dict[str, Any]:
        """The ``reset(options=...)`` that resets only the envs ``env_idx``."""
        ...

    def env_info(self) -> dict | None: ...

    def max_episode_steps(self) -> int | None: ...

    # render_substeps=True (`fastrecord.substeps`)
    def start_substeps(self) -> int:
        """Hook every env's physics substeps (capturing off); returns ``sim_steps_per_control``, or raises a
        ValueError/TypeError naming what this env kind lacks."""
        ...

    def substep_capture(self, on: bool) -> None:
        """Render a frame after each physics substep of the coming steps (or stop)."""
        ...

    def step_frames(self, post: Any) -> Any:
        """This step's frames ``[num_envs, substeps + 1, H, W, 3]``: the substeps', then ``post`` (the frame
        after the step)."""
        ...

    def stop_substeps(self) -> None: ...


class ManiSkillView:
    """Reads a ManiSkill env through its wrapper chain (``env``) and its ``BaseEnv`` (``base``)."""

    def __init__(self, env: gym.Env) -> None:
        self.env = env
        # gymnasium types ``unwrapped`` as its Env: here it is ManiSkill's BaseEnv (checked just below)
        self.base: BaseEnv = cast(BaseEnv, env.unwrapped)
        # ManiSkill's batched-env contract, checked by duck typing so test doubles can stand in
        missing = [
            a
            for a in ("num_envs", "device", "get_state_dict", "render", "single_action_space")
            if not hasattr(self.base, a)
        ]
        if missing:
            raise TypeError(
                f"fastrecord.RecordEpisode records ManiSkill envs or gymnasium vector envs of them; got "
                f"{type(self.base).__name__} (no {', '.join(missing)}). "
                "Create the env with gym.make('<ManiSkill env id>', ...)"
            )
        self.num_envs = self.base.num_envs
        self.device = torch.device(self.base.device)
        # CPUGymWrapper (below this wrapper) returns unbatched numpy: add the env dim back
        self.unbatched = False
        cur: Any = env
        while isinstance(cur, gym.Wrapper):
            if isinstance(cur, CPUGymWrapper):
                self.unbatched = True
                break
            cur = cur.env
        self.render_mode = self.base.render_mode
        self.single_action_space = self.base.single_action_space
        self._substeps: SubstepCapture | None = None

    @property
    def per_env_seeds(self) -> bool:
        return self.num_envs > 1

    def start_substeps(self) -> int:
        self._substeps = SubstepCapture.attach(self.base, self.env.render)  # renders as ManiSkill's hook: env.render()
        return self._substeps.substeps

    def substep_capture(self, on: bool) -> None:
        assert self._substeps is not None, "start_substeps() first"
        self._substeps.active = on

    def step_frames(self, post: Any) -> Any:
        capture = self._substeps
        assert capture is not None, "start_substeps() first"
        sub = capture.take()
        if sub is None:
            return step_frames(post, [None] * self.num_envs, capture.substeps)
        return torch.cat([sub.to(post.device), post[:, None]], dim=1)

    def stop_substeps(self) -> None:
        if self._substeps is not None:
            self._substeps.detach()

    def partial_reset_options(self, env_idx: Sequence[int] | np.ndarray) -> dict[str, Any]:
        return {"env_idx": torch.as_tensor(np.asarray(env_idx, dtype=np.int64))}

    def batch(self, x: Any) -> Any:
        return to_batched(x, None, self.unbatched)

    def render(self) -> Any:
        lut.supply_env(self.base)  # a new scene's cameras, before their first picture: the BRDF table (render/lut.py)
        return self.env.render()

    def state_dict(self, refresh: bool = False) -> dict:
        return self.base.get_state_dict()

    def episode_seeds(self) -> np.ndarray:
        return np.asarray(self.base._episode_seed, dtype=np.int64).reshape(-1).copy()

    @property
    def control_mode(self) -> str | None:
        return self.base.control_mode

    def env_info(self) -> dict | None:
        info = parse_env_info(self.env)
        if info is not None:
            info["max_episode_steps"] = self.max_episode_steps()
        return info

    def max_episode_steps(self) -> int | None:
        return gym_utils.find_max_episode_steps_value(self.env)


class VectorEnvView:
    """Reads a gymnasium ``VectorEnv`` whose sub-envs are ManiSkill CPU envs."""

    def __init__(self, envs: gym.vector.VectorEnv) -> None:
        # Any: what the view calls (call, get_attr) is Sync/AsyncVectorEnv's, forwarded by wrappers such as
        # `SubEnvAccess`; gymnasium's VectorEnv, the type every such env shares, does not declare it (the cast:
        # an Any-typed attribute would still be narrowed to VectorEnv by the assignment, in this method)
        self.env: Any = cast(Any, envs)
        self.num_envs = envs.num_envs
        self.device = torch.device("cpu")
        self.unbatched = False
        self._state_layout: list[tuple[list[str], int]] | None = None
        self._substeps: list[SubstepCapture] | None = None  # render_substeps on a SyncVectorEnv: one per sub-env
        self._substep_count = 0
        self.single_action_space = envs.single_action_space
        self.render_mode = envs.render_mode or envs.metadata.get("render_mode")
        if self.render_mode is None:
            try:
                self.render_mode = self.env.get_attr("render_mode")[0]
            except Exception:  # noqa: BLE001 - reported as "no render mode" by the recorder
                self.render_mode = None

    per_env_seeds = True  # sub-envs are separate envs, each reset with its own seed

    def start_substeps(self) -> int:
        vec = self.env.unwrapped
        if isinstance(vec, gym.vector.SyncVectorEnv):  # sub-envs in this process: hook them here
            self._substeps = [SubstepCapture.attach(e.unwrapped, e.render) for e in vec.envs]
            counts = {c.substeps for c in self._substeps}
        else:  # sub-envs in other processes: each must render its own (a SubstepFrames wrapper)
            lacking = [i for i, has in enumerate(vec.call("has_wrapper_attr", SWITCH)) if not has]
            if lacking:
                raise ValueError(
                    f"render_substeps=True on a {type(vec).__name__}: its sub-envs run in other processes, where the "
                    f"recorder cannot hook their physics substeps, and sub-envs {lacking} are not wrapped in "
                    f"fastrecord.substeps.SubstepFrames, which renders them there. Wrap each sub-env in its env "
                    "function (lambda: SubstepFrames(gym.make(...))), use a SyncVectorEnv, or pass "
                    "render_substeps=False"
                )
            self._substeps = None
            counts = set(vec.call(SWITCH, False))
        if len(counts) != 1:
            raise ValueError(
                f"render_substeps=True needs one sim_steps_per_control in every sub-env, got {sorted(counts)}; "
                f"make the sub-envs with the same sim_config"
            )
        self._substep_count = counts.pop()
        return self._substep_count

    def substep_capture(self, on: bool) -> None:
        if self._substeps is not None:
            for c in self._substeps:
                c.active = on
        else:
            self.env.unwrapped.call(SWITCH, on)

    def step_frames(self, post: Any) -> Any:
        if self._substeps is not None:
            subs = [None if (f := c.take()) is None else f[0] for c in self._substeps]
        else:
            subs = list(self.env.unwrapped.call(TAKE))
        return step_frames(post, subs, self._substep_count)

    def stop_substeps(self) -> None:
        for c in self._substeps or ():
            c.detach()

    def partial_reset_options(self, env_idx: Sequence[int] | np.ndarray) -> dict[str, Any]:
        mask = np.zeros(self.num_envs, dtype=bool)
        mask[np.asarray(env_idx, dtype=np.int64)] = True
        return {"reset_mask": mask}

    def batch(self, x: Any) -> Any:
        return to_batched(x, None, False)

    def render(self) -> Any:
        if getattr(self.env, "renders_batched", False):  # fastrecord.render: one batched render of every sub-env
            return self.env.render()
        # a SyncVectorEnv's sub-envs, in this process: a new scene's cameras get the BRDF table (render/lut.py)
        for sub_env in getattr(getattr(self.env, "unwrapped", None), "envs", ()):
            lut.supply_env(sub_env.unwrapped)
        # one call renders every sub-env (in parallel for AsyncVectorEnv)
        frames = self.env.call("render")
        if all(isinstance(f, np.ndarray) for f in frames):  # CPUGymWrapper's numpy: one numpy copy (torch.cat's
            # intra-op threads wait for cores that the sub-env processes hold)
            return torch.from_numpy(np.concatenate([f if f.ndim == 4 else f[None] for f in frames]))
        return torch.cat([to_batched(f, self.device, np.ndim(f) == 3) for f in frames], dim=0)

    def state_dict(self, refresh: bool = False) -> dict:
        """Env states of all sub-envs as one batched dict.

        Per step each sub-env sends one flat ``get_state()`` tensor (an AsyncVectorEnv pays an IPC round
        trip per tensor, so not one per dict leaf), split back into ``get_state_dict()``'s layout, which
        is learnt from one sub-env at the first call and whenever ``refresh`` (a reconfiguring reset).
        """
        if refresh or self._state_layout is None:
            template = flatten_tree(self.env.call("get_state_dict")[0], "")
            self._state_layout = [(k.lstrip("/").split("/"), v.shape[-1]) for k, v in template.items()]
        flat = torch.cat([torch.as_tensor(s).reshape(1, -1) for s in self.env.call("get_state")], dim=0)
        if flat.shape[1] != sum(w for _, w in self._state_layout):
            return self.state_dict(refresh=True)
        out: dict = {}
        start = 0
        for path, width in self._state_layout:
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = flat[:, start : start + width]
            start += width
        return out

    def episode_seeds(self) -> np.ndarray:
        return np.concatenate(
            [np.asarray(s, dtype=np.int64).reshape(-1)[:1] for s in self.env.get_attr("_episode_seed")]
        )

    @property
    def control_mode(self) -> str | None:
        """Sub-env 0's control mode, asked once (a ManiSkill env's is fixed at its make): the recorder reads it at
        every episode end, which may fall while the sub-envs reset (`RecordVectorEpisode.reset`)."""
        if "_control_mode" not in self.__dict__:
            self._control_mode = self.env.get_attr("control_mode")[0]
        return self._control_mode

    def env_info(self) -> dict | None:
        spec = self.env.get_attr("spec")[0]
        if spec is None:
            return None
        kwargs = dict(spec.kwargs)
        kwargs.pop("num_envs", None)
        return dict(env_id=spec.id, env_kwargs=kwargs, max_episode_steps=self.max_episode_steps())

    def max_episode_steps(self) -> int | None:
        spec = self.env.get_attr("spec")[0]
        if spec is not None and spec.max_episode_steps is not None:
            return int(spec.max_episode_steps)
        # ManiSkill's TimeLimitWrapper holds it. Only probe on a SyncVectorEnv: an AsyncVectorEnv worker
        # asked for an attribute its env lacks shuts down.
        if isinstance(self.env, gym.vector.AsyncVectorEnv):
            return int(self.env.get_attr("_max_episode_steps")[0])
        try:
            return int(self.env.get_attr("_max_episode_steps")[0])
        except AttributeError:
            return None



def env_keywords(env_id: str) -> set[str] | None:
    """The keywords ``gym.make(env_id, ...)`` accepts for a registered ManiSkill task: its class's
    ``__init__`` parameters and those of the bases it passes ``**kwargs`` on to, and gym.make's own; None
    where they cannot be told (not a ManiSkill task, or an ``__init__`` taking ``**kwargs`` to the end)."""
    import inspect

    from mani_skill.utils.registration import REGISTERED_ENVS

    spec = REGISTERED_ENVS.get(env_id)
    if spec is None:
        return None
    own = inspect.signature(gym.make).parameters.values()  # gym.make's own keywords (max_episode_steps, ...)
    names = {p.name for p in own if p.kind == p.POSITIONAL_OR_KEYWORD and p.name != "id"} | set(
        spec.default_kwargs or {}
    )
    for cls in spec.cls.__mro__:
        init = vars(cls).get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names
    return None


def check_env_kwargs(env_id: str, kwargs: Mapping[str, Any]) -> None:
    """A ValueError naming the first key of ``kwargs`` that ``gym.make(env_id, ...)`` would refuse, before
    any env is made."""
    import difflib

    known = env_keywords(env_id)
    if known is None:
        return
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(f"env_kwargs {key}={kwargs[key]!r}: {env_id} takes no keyword {key!r}; {hint}its gym.make "
                             f"keywords are {', '.join(sorted(known))}")
    check_reward_mode(env_id, kwargs.get("reward_mode"))
    check_robot_uids(kwargs.get("robot_uids"))


def check_robot_uids(robot_uids: Any) -> None:
    """A ValueError unless every robot of ``robot_uids`` (a name, a list of names, or None: the task's) is a
    registered ManiSkill robot (ManiSkill raises a RuntimeError from deep inside the env's constructor)."""
    import difflib

    from mani_skill.agents.registration import REGISTERED_AGENTS

    names = [robot_uids] if isinstance(robot_uids, str) else robot_uids if isinstance(robot_uids, (list, tuple)) else []
    for name in names:
        if isinstance(name, str) and name not in REGISTERED_AGENTS:
            close = difflib.get_close_matches(name, sorted(REGISTERED_AGENTS), n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(f"robot_uids={robot_uids!r}: {name!r} is not a registered ManiSkill robot; {hint}e.g. "
                             f"panda, fetch, xarm6_robotiq")


def check_reward_mode(env_id: str, reward_mode: Any) -> None:
    """A ValueError unless ``reward_mode`` (None: the task's) is one of the task's ``SUPPORTED_REWARD_MODES``
    (ManiSkill raises a NotImplementedError from inside the env's constructor)."""
    from mani_skill.utils.registration import REGISTERED_ENVS

    spec = REGISTERED_ENVS.get(env_id)
    supported = getattr(spec.cls, "SUPPORTED_REWARD_MODES", None) if spec is not None else None
    if reward_mode is not None and supported and reward_mode not in supported:
        raise ValueError(f"reward_mode={reward_mode!r} is not a reward mode of {env_id}; use one of "
                         f"{', '.join(supported)}")


def make_checked(env_id: str, **kwargs: Any) -> gym.Env:
    """``gym.make(env_id, **kwargs)``, where an env's refusal of a keyword's value (ManiSkill raises
    NotImplementedError, TypeError or ValueError from its constructor) becomes one ValueError naming the
    value, not a traceback from inside the env."""
    check_reward_mode(env_id, kwargs.get("reward_mode"))
    check_robot_uids(kwargs.get("robot_uids"))
    try:
        return gym.make(env_id, **kwargs)
    except Exception as e:
        if not (isinstance(e, (NotImplementedError, TypeError, ValueError))
                or type(e).__module__.split(".")[0] == "dacite"):  # a sim_config/sensor_configs key ManiSkill lacks
            raise
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k not in _OWN_KEYWORDS)
        raise ValueError(f"{env_id} refused its keywords ({given}): {type(e).__name__}: {e}; fix or drop the value "
                         f"it names") from e


# keywords fastrecord itself passes to gym.make (left out of the message above)
_OWN_KEYWORDS = ("render_mode", "enhanced_determinism", "human_render_camera_configs", "sim_backend", "render_backend")
