"""torchrun's PET_* variables: each of torchrun's options may come from `PET_<DEST>` instead of the command line.

torchrun's parser reads every option's default from `PET_` + its destination in capitals (torch's
distributed/argparse_util.py: `env` for an option with a value, `check_env` for a flag, where "1" is on and "0"
off); a flag on the command line wins. Kubeflow's PyTorchJob and TrainJob start `torchrun train.py` with nothing but
PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT, so `levers9 run` reads them the
same way: a drop-in that ignored them would run a world of one on each node. A PET_ variable of a torchrun option
that `levers9 run` does not take is refused by name, as the option is.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from levers9.errors import ConfigError

# torchrun's options (their argparse destinations) and whether each is a flag (check_env) or takes a value (env).
TORCHRUN_OPTIONS: dict[str, bool] = {
    "nnodes": False, "nproc_per_node": False, "rdzv_backend": False, "rdzv_endpoint": False, "rdzv_id": False,
    "rdzv_conf": False, "standalone": True, "max_restarts": False, "monitor_interval": False, "start_method": False,
    "event_log_handler": False, "role": False, "module": True, "no_python": True, "run_path": True, "log_dir": False,
    "redirects": False, "tee": False, "local_ranks_filter": False, "duplicate_stdout_filters": False,
    "duplicate_stderr_filters": False, "node_rank": False, "master_addr": False, "master_port": False,
    "local_addr": False, "signals_to_handle": False, "shutdown_timeout": False, "virtual_local_rank": True,
}  # fmt: skip
PROBLEMS = "pet_problems"  # the Namespace attribute that holds what `check` refuses


def variable(dest: str) -> str:
    """The PET_ variable of the option stored at `dest` (torchrun's rule)."""
    return f"PET_{dest.upper()}"


def read_pet_variables(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Make every torchrun option of `parser` default to its PET_ variable where that is set (a command-line flag
    still wins); what cannot be honoured is noted for `check`: the PET_ variable of a torchrun option `parser` does
    not take, a flag's variable that is not a whole number, a value outside the option's choices."""
    problems = []
    taken = set()
    for action in parser._actions:
        if action.dest not in TORCHRUN_OPTIONS:
            continue
        taken.add(action.dest)
        name = variable(action.dest)
        if name not in env:
            continue
        text = env[name]
        if TORCHRUN_OPTIONS[action.dest]:
            try:
                action.default = bool(int(text))
            except ValueError:
                problems.append(f"{name}={text!r}; expected 1 or 0 (torchrun reads it as a whole number)")
        elif action.choices and text not in action.choices:
            problems.append(f"{name}={text!r}; expected one of {', '.join(map(str, action.choices))}")
        else:
            action.default = text  # argparse converts a default string by the option's type, as a flag's value
    unaccepted = sorted(variable(d) for d in TORCHRUN_OPTIONS if d not in taken and variable(d) in env)
    if unaccepted:
        problems.append(f"{', '.join(unaccepted)} set, but levers9 run does not take the torchrun option(s) they "
                        f"stand for; expected only the PET_ variables of options levers9 run takes (`levers9 run "
                        f"--help`)")  # fmt: skip
    parser.set_defaults(**{PROBLEMS: problems})


def check(args: argparse.Namespace) -> None:
    """ConfigError for the first PET_ variable `levers9 run` could not honour (see `read_pet_variables`)."""
    problems = getattr(args, PROBLEMS, [])
    if problems:
        raise ConfigError(f"{problems[0]}. Unset it, or set it as torchrun's option takes it.")
