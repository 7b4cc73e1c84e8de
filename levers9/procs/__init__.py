"""Child processes, for `distributed.run`'s ranks and for jobs alike: one layer, used by both.

| file | side | what it holds |
| --- | --- | --- |
| start.py | parent | the start rule (fork where safe, else a fresh interpreter), the forker thread, pipes |
| watch.py | parent | a started child: output and messages pumped, exit status decoded, the tree stopped (SIGTERM to the caller too) |
| failure.py | both | what crosses the boundary: framed messages, a failure record, shipping by value |
| child.py | child | what runs in the child: stdio, signals, lifeline, the target, its outcome sent back |
| fds.py | parent | every descriptor the layer opens, so a forked child closes those that are not its own |
"""
