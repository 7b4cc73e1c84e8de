"""Prints, as one JSON line, what of torch's and Python's process-wide state code can see: every callable of
torch.distributed and distributed_c10d (by where it is defined), torch.autograd.backward, DDP.__init__, the
rendezvous handlers, the warning filters, the signal handlers, the root logger and the Python threads.

    python torch_state.py plain        # a process that never imported levers9 (after import torch)
    python torch_state.py imported     # after `import levers9` and its two layers, nothing run
    python torch_state.py levers9      # inside a rank of distributed.run(nprocs=2), and in its caller afterwards
    torchrun --nproc-per-node 2 torch_state.py torchrun   # inside a torchrun worker that made its group
"""

import gc
import importlib
import json
import logging
import os
import signal
import sys
import threading
import warnings
from typing import Any


def _where(obj: Any) -> str:
    code = getattr(obj, "__code__", None) or getattr(getattr(obj, "__func__", None), "__code__", None)
    name = f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    return f"{name}@{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else name


def _handler(value: Any) -> str:
    if value in (signal.SIG_DFL, signal.SIG_IGN, None):
        return str(value)
    return _where(value)


def snapshot() -> dict[str, Any]:
    import torch
    import torch.distributed as td
    import torch.distributed.distributed_c10d as c10d
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # td.rendezvous is also a function
    from torch.nn.parallel import DistributedDataParallel

    functions = {
        f"{module.__name__}.{name}": _where(getattr(module, name))
        for module in (td, c10d)
        for name in dir(module)
        if not name.startswith("__") and callable(getattr(module, name, None))
    }
    functions["torch.autograd.backward"] = _where(torch.autograd.backward)
    functions["DistributedDataParallel.__init__"] = _where(DistributedDataParallel.__init__)
    root = logging.getLogger()
    gc.collect()  # the collector as it settles: CPython 3.12 freezes its own immortal objects again at a full one
    return {
        "functions": functions,
        "rendezvous": {scheme: _where(fn) for scheme, fn in rendezvous._rendezvous_handlers.items()},
        "warning_filters": [repr(f) for f in warnings.filters],
        "signals": {s.name: _handler(signal.getsignal(s)) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)},
        "root_logger": [logging.getLevelName(root.level), [type(h).__name__ for h in root.handlers]],
        "levers9_logger": [h for h in (type(h).__name__ for h in logging.getLogger("levers9").handlers)],
        "threads": sorted(t.name for t in threading.enumerate()),
        "collector": [gc.isenabled(), list(gc.get_threshold()), gc.get_freeze_count()],
    }


def in_a_rank(cfg: Any) -> dict[str, Any]:
    return snapshot()


if __name__ == "__main__":
    mode = sys.argv[1]
    import torch.distributed  # noqa: F401 - every mode has torch imported
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    if mode == "plain":
        print("STATE " + json.dumps(snapshot()), flush=True)
    elif mode == "imported":
        import levers9  # noqa: F401
        import levers9.distributed  # noqa: F401
        import levers9.launch  # noqa: F401

        print("STATE " + json.dumps(snapshot()), flush=True)
    elif mode == "levers9":
        from levers9 import distributed as dist

        rank = dist.run(in_a_rank, None, nprocs=2)
        print("RANK " + json.dumps(rank), flush=True)
        print("CALLER " + json.dumps(snapshot()), flush=True)
    elif mode == "torchrun":
        torch.distributed.init_process_group("gloo")
        state = snapshot()
        if torch.distributed.get_rank() == 0:
            print("RANK " + json.dumps(state), flush=True)
        torch.distributed.destroy_process_group()
