"""`kvtool serve` in a child process, where tests import it from (it lives in kvtool.serving.server_process)."""

from kvtool.serving.server_process import ServerProcess, children, free_port

__all__ = ["ServerProcess", "children", "free_port"]
