"""What a torchrun worker can see of its launcher's options, one line on stdout and one on stderr per rank, each
written whole (both ranks share the launcher's streams). No torch import: the options table runs it many times."""

import os
import sys

env = os.environ
error_file = env.get("TORCHELASTIC_ERROR_FILE", "")
seen = {
    "rank": env["RANK"],
    "local": env["LOCAL_RANK"],
    "world": env["WORLD_SIZE"],
    "role": env["ROLE_NAME"],
    "restart": env["TORCHELASTIC_RESTART_COUNT"],
    "max_restarts": env["TORCHELASTIC_MAX_RESTARTS"],
    "cuda_visible": env.get("CUDA_VISIBLE_DEVICES"),
    "port": "the one asked" if env["MASTER_PORT"] == env.get("WANT_PORT") else "another",
    "error_file": "/".join(error_file.split(os.sep)[-3:]),  # attempt_<n>/<local rank>/error.json
    "main": __name__,
    "argv": sys.argv[1:],
}
line = " ".join(f"{key}={value}" for key, value in seen.items())
sys.stdout.write(f"SEEN apple {line}\n")
sys.stdout.flush()
sys.stderr.write(f"SAID orange rank={seen['rank']}\n")
sys.stderr.flush()
