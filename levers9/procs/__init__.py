"""Child processes, for `distributed.run`'s ranks and for jobs alike: start.py starts them, watch.py watches
and stops them, lines.py cuts and forwards their output, watch.py finds what they started, failure.py is what
crosses the boundary, child.py runs inside them, fds.py keeps a forked child from holding descriptors that
are not its own. Each file's docstring says which side of the fork runs it.
"""
