"""A script that torchrun or accelerate launches and that hands code to distributed.run, in one process: a
torchrun main() that makes and destroys its group (init_group=False), one whose group is gone before a
levers9 helper needs one (init_group=False), one that calls a collective as code written for a live group
does, and one that reports what it sees at its top."""

import json

from levers9 import distributed as dist
from tests import scriptfns

if __name__ == "__main__":
    for fn in (scriptfns.torchrun_main, scriptfns.torchrun_main_then_helpers):
        print(f"RESULT {fn.__name__} {json.dumps(dist.run(fn, init_group=False))}", flush=True)
    for fn in (scriptfns.raw_collective, scriptfns.what_fn_sees):
        print(f"RESULT {fn.__name__} {json.dumps(dist.run(fn))}", flush=True)
