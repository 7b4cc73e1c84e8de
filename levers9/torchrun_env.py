"""torchrun's PET_* variables: each of torchrun's options may come from `PET_<DEST>` instead of the command line.

torchrun's parser reads every option's default from `PET_` + its destination in capitals (torch's
distributed/argparse_util.py: `env` for an option with a value, `check_env` for a flag, where "1" is on and "0"
off); a flag on the command line wins. Kubeflow's PyTorchJob and TrainJob start `torchrun train.py` with nothing but
PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT, so `levers9 run` reads them the
same way: a drop-in that ignored them would run a world of one on each node. `levers9 run` takes every torchrun
option (a PET_ variable's value is then checked as the option's is).
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
    for action in parser._actions:
        if action.dest not in TORCHRUN_OPTIONS:
            continue
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
    parser.set_defaults(**{PROBLEMS: problems})


def check(args: argparse.Namespace) -> None:
    """ConfigError for the first PET_ variable `levers9 run` could not honour (see `read_pet_variables`)."""
    problems = getattr(args, PROBLEMS, [])
    if problems:
        raise ConfigError(f"{problems[0]}. Unset it, or set it as torchrun's option takes it.")
