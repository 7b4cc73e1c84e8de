"""A script that configures logging itself, as most training scripts do, and a library that logs before it."""

import logging
import os

lib = logging.getLogger("somelib")
lib.info("somelib says hello at INFO")  # no handler yet: a fresh interpreter prints nothing
lib.warning("somelib warns")  # Python's last-resort handler prints this one, bare
logging.basicConfig(format="MYFMT %(levelname)s %(name)s: %(message)s", level=logging.INFO)
logging.getLogger("train").info("rank %s step 1", os.environ.get("RANK"))
lib.debug("somelib debug line")  # below the script's level
