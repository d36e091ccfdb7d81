"""Run vLLM as a child process and switch speculative decoding by restarting it.

vLLM 0.32 fixes the speculative config at start, so "toggle SD" means "restart vLLM with or
without ``--speculative-config``". ``profile`` derives both command lines (pure), ``state``
holds the values and the state file, ``child`` owns one vLLM process, ``supervisor`` drives
restarts, rollbacks and crash recovery, ``admin`` is the HTTP API, ``cli`` wires them up.
"""
