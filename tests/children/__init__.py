"""Scripts the tests run as child processes (a real SIGINT or SIGKILL needs a process)."""
