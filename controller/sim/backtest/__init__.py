"""Replaying history through the real decision logic (``sd-controller backtest``).

Four steps, one module each:

* :mod:`.history` reads what happened: a CSV of observations, or Prometheus ``query_range``
  answers fed to the daemon's own :class:`~controller.sources.prometheus.PrometheusSource`;
  either becomes a list of :class:`~.history.Step`.
* :mod:`.replay` drives the unchanged :class:`~controller.loop.Controller` through the steps on
  their clock, with a hook that applies a requested change at once.
* :mod:`.scoring` turns each tick into a :class:`~.scoring.StepRecord` and sums the model's
  predicted gain: Σ over steps of (latency in the recorded state − latency in the controller's
  state) × arrival rate × step, minus the estimated switch cost
  (``Assessment.switch_cost_request_s``) of each toggle.
* :mod:`.report` presents it (table, plot) with the open-loop caveat: history with SD off
  carries no acceptance (vLLM exports none), so the replay uses the last measured value, then
  the prior; and the controller's own toggles would have changed the latency and queueing that
  the history shows, which a replay cannot observe. The gain is the model's prediction, not a
  measurement.
"""
