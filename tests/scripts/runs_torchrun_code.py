"""A script that torchrun or accelerate launches and that hands code to distributed.run, in one process: a
torchrun main() that makes and destroys its group (init_group=False; rank 0's value then reaches every rank
through a group levers9 makes for it), code that calls a collective as code written for a live group does,
and code that reports what it sees at its top. (Only one fn here makes its own group: torch itself reuses a
destroyed group's store keys for the next group made on torchrun's store, pytorch/pytorch#135712.)"""

import json

from levers9 import distributed as dist
from tests import scriptfns

if __name__ == "__main__":
    print(f"RESULT torchrun_main {json.dumps(dist.run(scriptfns.torchrun_main, init_group=False))}", flush=True)
    for fn in (scriptfns.raw_collective, scriptfns.what_fn_sees):
        print(f"RESULT {fn.__name__} {json.dumps(dist.run(fn))}", flush=True)
