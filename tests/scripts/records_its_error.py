"""A torchtitan-style entry point under torch's @record: rank 1 raises, and @record writes the error to the file
TORCHELASTIC_ERROR_FILE names."""

import os

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("no shard for rank 1")


if __name__ == "__main__":
    main()
