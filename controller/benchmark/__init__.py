"""Measuring a server for calibration: the micro-benchmark and the load test.

One protocol (:mod:`controller.benchmark.probe`) with two kinds of server behind it: a real
vLLM over HTTP, and a simulated one. The measurement logic never knows which it talks to, so
the simulator is calibrated exactly the way a user calibrates a real server.
"""
