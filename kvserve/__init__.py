"""The applications on top of kvserve's services and libraries: the `kvserve` command
(kvserve/cli/) and the trace-replay client it and bench/ use (kvserve/replay/).

Layering, checked by tests/unit/test_import_graph.py: kvserve/ may import services/ and
libs/; services/ import libs/ only, never each other; libs/ import neither.
"""
