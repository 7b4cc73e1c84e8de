"""A script that torchrun or accelerate launches and that hands code written for torchrun to
distributed.run, three times in one process: a main() that makes and destroys its group, one whose
group is gone before a levers9 helper needs one, and one that calls a collective with no group."""

import json

from levers9 import distributed as dist
from tests import scriptfns

if __name__ == "__main__":
    for fn in (scriptfns.torchrun_main, scriptfns.torchrun_main_then_helpers, scriptfns.raw_collective):
        print(f"RESULT {fn.__name__} {json.dumps(dist.run(fn))}", flush=True)
