"""The ``fastrecord`` command: record, replay, bench, info, gallery, merge, consolidate.

    fastrecord record PickCube-v1                     # record 4 episodes (CPU sim/render work)
    fastrecord record --help                          # every flag, with its default
    fastrecord info recordings                        # what a run holds (--json for machines)
    fastrecord gallery recordings                     # recordings/gallery.html: the videos, filterable
    torchrun --standalone --nproc-per-node 2 -m fastrecord record PickCube-v1 --episodes 100   # sharded
    fastrecord merge recordings                       # (re)join a sharded run's shards
    fastrecord consolidate recordings/trajectory.h5   # a crashed run's parts -> one self-contained file
    fastrecord --version                              # or -V
    FASTRECORD_DEBUG=1 fastrecord record ...          # or --debug: errors with their traceback

Each subcommand lives in its own module with ``configure_parser(parser)`` and ``main_from_args(args)``.
A mistake in the options or the config file is one line, ``fastrecord <cmd>: error: ...``, and exit
status 2, before anything is written; so is an input file ``replay`` refuses (bad data, missing parts).
A failure while a command runs (a full disk, a read-only folder, missing credentials) is one line saying
what was kept, and exit status 1. Ctrl-C (SIGINT) and SIGTERM stop ``record`` and ``replay`` cleanly:
the env is closed (``record`` drops the episodes in progress, which ``--if-exists resume`` records whole;
a one-process ``replay`` saves its replays in progress), the summary is printed, and the exit status is 130 /
143. An unknown ``--obs-mode`` or ``--control-mode`` (ManiSkill's own check), or a CUDA backend on a
machine without CUDA, is the same one-line error naming the valid values. ManiSkill's repeated third-
party warnings are silenced here (the library itself is left as it is).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import re
import signal
import sys
import threading
import typing
from typing import Any

from fastrecord.render.device import CUDA_NAMES, on_cuda
from fastrecord.system import quiet_third_party

# name: (module, one-line help, the config dataclass its flags fill: its defaults and comments are the flags' help)
SUBCOMMANDS = {
    "record": (
        "fastrecord.commands.record",
        "run a policy in N envs and record its episodes",
        "fastrecord.commands.config:RecordConfig",
    ),
    "replay": (
        "fastrecord.commands.replay",
        "replay saved trajectories: re-render videos, convert observation modes",
        "fastrecord.commands.replay:ReplayConfig",
    ),
    "bench": (
        "fastrecord.commands.bench",
        "measure recording throughput against ManiSkill's RecordEpisode",
        "benchmarks.config:BenchConfig",
    ),  # the checkout's benchmarks/, loaded by commands/bench.py
    "info": (
        "fastrecord.commands.info",
        "summarize recorded runs: episodes, success, keys, shapes, sizes, status",
        None,
    ),
    "gallery": (
        "fastrecord.commands.gallery",
        "write DIR/gallery.html: the run's videos, labelled and filterable",
        None,
    ),
    "merge": ("fastrecord.commands.merge", "join a sharded run's shards (torchrun) into one NAME.h5 + NAME.json", None),
    "consolidate": (
        "fastrecord.commands.consolidate",
        "make a crashed or linked run's NAME.h5 one self-contained file",
        None,
    ),
}

SIM_BACKENDS = ("physx_cpu", "cpu", "physx_cuda", "cuda", "gpu")  # ManiSkill's names (CUDA ones also as cuda:N)
CUDA_SIM = ("physx_cuda", "cuda", "gpu")
DEBUG_ENV = "FASTRECORD_DEBUG"  # set (not "" or "0"): errors keep their traceback
RUNTIME_MODULES = ("h5py", "av", "wandb")  # libraries whose errors reaching main are runtime failures (exit 1)
KEEPS_EPISODES = ("record", "replay")  # commands whose finished episodes stay on disk after a failure


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Module docstrings kept as written; an option's default appended to its help, as
    `argparse.ArgumentDefaultsHelpFormatter` does, except where it says nothing (None, a help text that
    already names its default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        if not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose error is one line, ``fastrecord record: error: MESSAGE;
    see fastrecord record --help``, exit status 2: argparse's own printed the whole usage (30 lines for
    ``record``) before it."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _field_comments(cls: type) -> dict[str, str]:
    """{field: its one-line comment} from a config dataclass's source (``name: type = value  # comment``)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return {m[1]: m[2].strip() for m in re.finditer(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+)$", source, re.MULTILINE)}


def _default_text(value: Any) -> str:
    return "none" if value is None else str(value).replace("%", "%%")


def document_defaults(parser: argparse.ArgumentParser, config: str | None) -> None:
    """Give every flag of a config-backed subcommand its help and default from the dataclass.

    The subcommands' flags default to None (meaning "not given": the --config file or the dataclass fills
    the value), so argparse alone would print "default: None"; the real default is the field's."""
    if config is None:
        return
    module, _, name = config.partition(":")
    cls = getattr(importlib.import_module(module), name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    comments = _field_comments(cls)
    for action in parser._actions:
        f = fields.get(action.dest)
        if f is None or action.default is not None:
            continue
        text = action.help or comments.get(action.dest, "").replace("%", "%%")
        if "default" in text.lower():
            action.help = text
            continue
        if f.default is dataclasses.MISSING:
            action.help = text
            continue
        if f.default is None:  # "not given": the comment's "(None: the task's)" says what that means
            # (not "default: none", which reads as the value none: a reward mode, among others)
            meaning = re.search(r"\(None: ([^)]*)\)", comments.get(action.dest, ""))
            text = re.sub(r"\s*\(None: [^)]*\)", "", text)
            action.help = f"{text} (default: {meaning[1] if meaning else 'unset'})".lstrip()
            continue
        if isinstance(action, argparse._StoreConstAction) and isinstance(f.default, bool):
            # what the switch sets, then the default: "(default: save_video=True)" alone read as the flag's value
            action.help = f"{text} (sets {action.dest}={action.const}; default {action.dest}={f.default})".lstrip()
        elif f.default == "" or f.default == ():
            action.help = text
        else:
            action.help = f"{text} (default: {_default_text(f.default)})".lstrip()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from fastrecord import __version__

    parts = []
    for dist in ("mani_skill", "sapien", "torch"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
    return f"fastrecord {__version__} ({', '.join(parts)}; Python {sys.version.split()[0]})"


# ---------------------------------------------------------------------------------------------- checks
def _requested(args: argparse.Namespace, key: str) -> Any:
    """The value a run will use for ``key``: its flag, else its --config file's value (None if neither)."""
    value = getattr(args, key, None)
    if value is not None or not getattr(args, "config", None):
        return value
    try:
        import yaml

        with open(args.config) as f:
            loaded = yaml.safe_load(f)
    except Exception:  # noqa: BLE001 - the subcommand reports a bad config file itself
        return None
    return loaded.get(key) if isinstance(loaded, dict) else None


def _cuda_available() -> bool:
    from fastrecord.system import torch_sees_cuda

    return torch_sees_cuda()


def check_env_options(args: argparse.Namespace) -> None:
    """Refuse, before any env is made, what ManiSkill would refuse late or with a traceback: an unknown
    sim backend or observation mode, a CUDA backend where there is no CUDA. Raises ValueError."""
    sim = _requested(args, "sim_backend")
    if isinstance(sim, str) and sim != "auto":
        base = sim.split(":")[0]
        if base not in SIM_BACKENDS:
            raise ValueError(f"sim_backend={sim!r} is unknown; use one of {', '.join(SIM_BACKENDS)} "
                             f"(CUDA ones also as cuda:N)")
        if base in CUDA_SIM and not _cuda_available():
            raise ValueError(f"sim_backend={sim!r} needs a CUDA device and this machine has none (torch sees no CUDA); "
                             f"use --sim-backend physx_cpu")
    render = _requested(args, "render_backend")
    if isinstance(render, str) and on_cuda(render) and not _cuda_available():
        raise ValueError(
            f"render_backend={render!r} needs a CUDA device and this machine has none (torch sees no CUDA); "
            f"use --render-backend cpu (or auto)"
        )
    obs_mode = _requested(args, "obs_mode")
    if isinstance(obs_mode, str):
        from mani_skill.envs.utils.observations import parse_obs_mode_to_struct

        try:
            parse_obs_mode_to_struct(obs_mode)
        except AssertionError as e:
            raise ValueError(rephrase_maniskill_error(e, args) or str(e)) from None


_BAD_CONTROL = re.compile(r"^(.+?) not in supported modes: (\[.*\])\s*$", re.DOTALL)
_BAD_TEXTURE = re.compile(r"Invalid texture type '(.*?)' requested in the obs mode '(.*?)'")


def obs_mode_choices() -> str:
    from mani_skill.envs.utils.observations import ALL_VISUAL_TEXTURES

    return (f"state, state_dict, none, sensor_data, rgbd, pointcloud, or camera textures joined with '+' "
            f"({', '.join(ALL_VISUAL_TEXTURES)}; e.g. rgb, rgb+depth, state+rgb)")


def rephrase_maniskill_error(e: BaseException, args: argparse.Namespace) -> str | None:
    """ManiSkill's own refusal of a control or observation mode (an AssertionError), as one line naming
    the valid values; None for anything else (which then keeps its traceback)."""
    text = str(e).strip()
    task = _requested(args, "env_id") or "this task"
    if m := _BAD_CONTROL.match(text):
        import ast

        try:
            valid = ", ".join(ast.literal_eval(m[2]))
        except (ValueError, SyntaxError):
            valid = m[2]
        return f"control_mode={m[1]!r} is not supported by {task}'s robot; use one of {valid}"
    if m := _BAD_TEXTURE.search(text):
        return f"obs_mode={m[2]!r} is unknown ({m[1]!r} is not a camera texture); use {obs_mode_choices()}"
    if isinstance(e, RuntimeError) and 'failed to find device "cuda' in text:
        return f"a CUDA device was requested ({text}) and this machine has none; use physx_cpu / cpu backends"
    return None


# ---------------------------------------------------------------------------------------------- runtime failures
def is_runtime_failure(e: BaseException) -> bool:
    """Whether ``e`` is a failure a user can meet while a command runs (exit 1, one line), not a bad option
    (a ValueError: exit 2) nor a bug (kept with its traceback): an OS error (disk full, permissions, a
    missing folder), a background writer's or encoder's `fastrecord.WorkerError`, an error of HDF5, PyAV
    or W&B, a logger without its login, a batched render that cannot go on."""
    from fastrecord.render import BatchedRenderError
    from fastrecord.sinks.loggers import LoggerLoginError
    from fastrecord.workers import WorkerError

    if isinstance(e, (OSError, WorkerError, LoggerLoginError, BatchedRenderError)):
        return True
    return any(c.__module__.split(".")[0] in RUNTIME_MODULES for c in type(e).__mro__)


_CHILD_TRACEBACK = re.compile(r"\s*\([^()]*traceback:.*", re.DOTALL)


def failure_line(e: BaseException, args: argparse.Namespace) -> str:
    """``e`` as one line (a child process's traceback quoted in its message dropped), then, for the
    commands that record, where the episodes finished before it are kept."""
    text = _CHILD_TRACEBACK.sub("", str(e)).strip() or type(e).__name__
    if isinstance(e, OSError) and e.strerror:  # the OS's words and the path, without "[Errno N]"
        text = e.strerror if e.filename is None else f"{e.strerror}: {e.filename}"
    text = " ".join(text.split())
    from fastrecord.sinks.loggers import LoggerLoginError

    started = not isinstance(e, LoggerLoginError)  # a login is checked before anything is made
    if started and args.command in KEEPS_EPISODES and "kept" not in text and "safely on disk" not in text:
        out = _requested(args, "output_dir") or _config_default(args.command, "output_dir")
        if out is None:  # replay's default: a folder next to its input
            text += "; the episodes finished before the failure are kept and readable in its output folder"
        elif os.path.isdir(out):
            text += (f"; the episodes finished before the failure are kept and readable in {out} "
                     f"(fastrecord info {out})")
        else:
            text += f"; nothing was written ({out} was not left behind)"
    return text


def _config_default(command: str, key: str) -> Any:
    """The default of ``key`` in ``command``'s config dataclass (None: no such field)."""
    config = SUBCOMMANDS.get(command, (None, None, None))[2]
    if config is None:
        return None
    module, _, name = config.partition(":")
    try:
        fields = {f.name: f for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
    except (ImportError, AttributeError, TypeError):
        return None
    f = fields.get(key)
    return None if f is None or f.default is dataclasses.MISSING else f.default


def check_logger_credentials(args: argparse.Namespace) -> None:
    """``--log wandb`` without W&B credentials: refused before any env is made (`LoggerLoginError`)."""
    if _requested(args, "log") == "wandb":
        from fastrecord.sinks.loggers import check_wandb_login

        check_wandb_login()


def build_parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """The ``fastrecord`` parser and {subcommand: its module}. ``only``: configure that subcommand alone
    ("" none): the others are listed with their one-line help, and their modules (several import torch
    and ManiSkill) are not imported, so ``fastrecord --version`` or ``fastrecord info`` start at once."""
    parser = ArgumentParser(prog="fastrecord", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=_version())
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,  # main() takes it off the line
                        help=f"let errors end in their traceback (as {DEBUG_ENV}=1; accepted anywhere on the line)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    modules = {}
    for name, (module, help_, config) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue  # subcommand not built in this version
            raise
        modules[name] = mod
        p = sub.add_parser(name, help=help_, description=mod.__doc__, formatter_class=HelpFormatter)
        mod.configure_parser(p)
        document_defaults(p, config)
    return parser, modules


def _flag(argv: list[str], *names: str) -> str | None:
    """The value of the last ``--name VALUE`` / ``--name=VALUE`` of ``names`` in ``argv`` (None: absent)."""
    value = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(n + "="):
                value = a.split("=", 1)[1]
    return value


def _replay_forks(argv: list[str]) -> bool:
    """Whether ``argv`` is a ``replay`` that will fork processes from the forkserver: worker processes
    (``--workers N``, N > 1; by default on machines of `MANY_CORES` cores) or the sub-envs of a CPU vector
    env (``--vector async``, several envs drawn by the CPU, or more than `ENVS_PER_WORKER` envs in one process;
    ``--num-envs`` is by default one per core), not the one batched env of GPU simulation. A cheap guess from the
    command line
    only (`fastrecord.replay.plan` decides): a wrong guess costs an idle server process, or a later start."""
    from fastrecord.replay.layout import ENVS_PER_WORKER, MANY_CORES

    if not argv or argv[0] != "replay" or "-h" in argv or "--help" in argv:
        return False
    workers, envs, vector = _flag(argv, "--workers"), _flag(argv, "--num-envs", "-n"), _flag(argv, "--vector")
    if workers is not None and workers.isdigit() and int(workers) > 1:
        return True
    backend = _flag(argv, "--sim-backend", "-b")
    if (backend is not None and backend.split(":")[0] in CUDA_SIM) or vector == "batched":
        return False
    from fastrecord.workers import usable_cores  # not fastrecord.options: numpy, before the forkserver starts

    cores = usable_cores()
    maniskill = any(a == "--traj-path" or a.startswith("--traj-path=") for a in argv)  # ManiSkill's command line
    n = int(envs) if envs is not None and envs.isdigit() else (1 if envs is not None or maniskill else cores)
    if n <= 1:
        return False
    # several workers (on a GPU: while n > ENVS_PER_WORKER), unless a logger takes the replays (one process)
    if workers is None and cores >= MANY_CORES and "--log" not in argv:
        return True
    if vector in (None, "auto") and _replay_draws(argv, maniskill):  # drawn by the CPU: each env in a sub-env
        from fastrecord.system import has_nvidia_gpu  # process (`fastrecord.replay.ahead`)

        render = (_flag(argv, "--render-backend") or "auto").split(":")[0]
        if (render in ("cpu", "sapien_cpu") or not has_nvidia_gpu()) and "--render-substeps" not in argv:
            return True
    return vector == "async" or (vector != "sync" and n > ENVS_PER_WORKER)


def _replay_draws(argv: list[str], maniskill: bool) -> bool:
    """Whether the replay (or record) of ``argv`` draws pictures (`fastrecord.replay.plan`'s ``_draws``, from the
    command line only): camera observations (``--obs-mode`` / ``-o``), videos (a replay's default; ManiSkill's command
    line: ``--save-video``) or a logger's (``--log``)."""
    obs = _flag(argv, "--obs-mode", "-o")
    videos = "--save-video" in argv if maniskill else "--no-video" not in argv
    return videos or "--log" in argv or obs not in (None, "state", "state_dict", "none")


def _record_forks(argv: list[str]) -> bool:
    """Whether ``argv`` is a ``record`` whose envs will step in processes from the forkserver: CPU simulation,
    ``--num-envs`` > 1 and the batched render (``--batched-render on``, or auto with a GPU render backend on a
    machine with an NVIDIA driver), or envs drawn by the CPU that draw something (`fastrecord.reported`). A cheap
    guess from the command line only, as `_replay_forks`: a config file's values are not read (the server then starts
    when the envs are made)."""
    if not argv or argv[0] != "record" or "-h" in argv or "--help" in argv:
        return False
    envs, backend = _flag(argv, "--num-envs"), _flag(argv, "--sim-backend")
    if envs is None or not envs.isdigit() or int(envs) <= 1:
        return False
    if (backend is not None and backend.split(":")[0] in CUDA_SIM) or _flag(argv, "--vector") == "sync":
        return False
    batched = _flag(argv, "--batched-render") or "auto"
    if batched == "on":
        return True
    from fastrecord.system import has_nvidia_gpu

    render = (_flag(argv, "--render-backend") or "auto").split(":")[0]
    gpu = render in CUDA_NAMES + ("auto",) and has_nvidia_gpu()
    if gpu and batched == "auto":
        return True
    # drawn by the CPU: each env in a process of its own (`fastrecord.reported`), where the envs draw something
    # (`_replay_draws`' rule; --policy's reads_simulator is not known here: a wrong guess costs an idle server)
    cpu = render in ("cpu", "sapien_cpu") or (render == "auto" and not gpu)
    async_ = _flag(argv, "--vector") == "async"
    return (async_ or cpu) and "--render-substeps" not in argv and _replay_draws(argv, False)


def main(argv: list[str] | None = None) -> int:
    from fastrecord.exits import install_signal_handlers
    from fastrecord.system import stamp, use_lavapipe_if_no_gpu

    stamp("main")

    use_lavapipe_if_no_gpu()
    install_signal_handlers()  # SIGTERM outside a run loop: SystemExit(143), so open writers still close
    args_in = sys.argv[1:] if argv is None else argv
    forks = _replay_forks(args_in) or _record_forks(args_in)
    from fastrecord import PRESTART_CORES
    from fastrecord.workers import affinity_cores

    if forks and affinity_cores() >= PRESTART_CORES:
        from fastrecord.workers import start_forkserver

        # its imports (torch, ManiSkill) run on other cores while ours run here; on fewer cores they would compete
        # with ours, and `replay` starts it after its imports instead, before it opens a file: this process forked
        # (`fastrecord.workers.start_forkserver`)
        start_forkserver()
        forks = False
    quiet_third_party()
    debug = "--debug" in args_in or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    args_in = [a for a in args_in if a != "--debug"]
    command = next((a for a in args_in if not a.startswith("-")), "")
    parser, modules = build_parser(only=command if command in SUBCOMMANDS else "")
    try:
        args, extra = parser.parse_known_args(args_in)
        if extra:  # said by the subcommand, whose --help lists its flags
            ArgumentParser(prog=f"fastrecord {args.command}").error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # a mistake on the command line (printed as one line): status 2, as other mistakes
        if e.code != 2:
            raise  # --help, --version
        return 2
    if args.command == "replay":
        args.forks = forks  # still to start: `replay` starts it once imported, before it opens a file
    early = _start_subenvs(modules[args.command], args)
    if early is not None:
        args.early = early
    try:
        if args.command in ("record", "replay"):
            check_env_options(args)
            check_logger_credentials(args)
        return modules[args.command].main_from_args(args)
    except BrokenPipeError:  # output piped into a program that stopped reading (| head): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        if debug:
            raise
        if is_runtime_failure(e):
            print(f"fastrecord {args.command}: error: {failure_line(e, args)}", file=sys.stderr)
            return 1
        message = str(e) if isinstance(e, ValueError) else None
        if isinstance(e, (AssertionError, RuntimeError)):  # ManiSkill refuses a mode with an assert
            message = rephrase_maniskill_error(e, args)
        if message is None:
            raise
        print(f"fastrecord {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run loop (loading, env creation): nothing half-written to save
        print(f"fastrecord {args.command}: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        if early is not None:  # processes the run did not take over (a refusal, a wrong guess); a no-op otherwise. Not
            # waiting for their starts: a refusal's one line would wait for the forkserver's preload (seconds)
            early.close(wait=False)


def _start_subenvs(module: Any, args: argparse.Namespace) -> Any:
    """The command's sub-env processes started before its checks and imports (its ``start_subenvs(args)``, where it
    has one: `record`, `replay`), or None. A mistake in the options starts nothing here: the command says it, in its
    own words, once it runs."""
    start = getattr(module, "start_subenvs", None)
    if start is None:
        return None
    try:
        return start(args)
    except Exception:  # noqa: BLE001 - reported by the command itself (main_from_args builds the same config)
        return None


def entry() -> None:
    """The ``fastrecord`` command (console script and ``python -m fastrecord``): `main`, then `exit_now`. Its process is
    fastrecord's own: the imports it never uses are deferred first (`fastrecord.deferred`)."""
    from fastrecord.deferred import install

    install()
    exit_now(main())


def exit_now(code: int) -> None:
    """Leave the process as Python's own exit does, minus its teardown of the modules: join the non-daemon
    threads, run the atexit hooks (multiprocessing's, loggers', fastrecord's), flush the standard streams,
    then ``os._exit``. That teardown (torch's and ManiSkill's shared libraries) took 1.2-1.4 s of every
    command on the 2-core machine, after the work was done and saved. Only for a normal return: an
    exception still goes through Python's exit."""
    import atexit

    from fastrecord.system import stamp

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    stamp("exit_threads_joined")  # benchmarks/bench_whole.py: where the seconds after the close go
    atexit._run_exitfuncs()
    stamp("exit_atexit_done")  # then only os._exit: the kernel's and drivers' teardown of the process
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (| head): nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
