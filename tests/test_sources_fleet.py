"""Fleet mode's view of the fleet: a real Prometheus scraping three vLLM-format servers; the
fleet's arrival rate is their sum, the replicas serving are counted, a replica that goes away
stops counting; a switch is priced with the replicas serving (a dip of one of N)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from controller.errors import ConfigError
from controller.hooks.exec import NoHook
from controller.loop import Controller
from controller.observation import Observation
from controller.settings import Settings, load_settings
from controller.sources.fleet import FleetSource, priced_for_fleet
from controller.sources.prometheus import PrometheusSource
from controller.sources.setup import build_source
from tests.support import LEGACY_CALIBRATION
from tests.support.fake_vllm import FakeVllmServer
from tests.test_loop import MODEL
from tests.test_sources_prometheus import Traffic


def fleet_source(prom, own_target):
    own = PrometheusSource(
        prom.url, f'instance="{own_target}"', rate_window_s=5, acceptance_window_s=10, long_window_s=20
    )
    return FleetSource(own, own, 'job="vllm"', rate_window_s=5, long_window_s=20)


@pytest.mark.prometheus
def test_the_fleet_rate_is_the_sum_and_a_replica_gone_stops_counting(prometheus_server):
    servers = [FakeVllmServer().start() for _ in range(3)]
    try:
        prom = prometheus_server({"vllm": [s.target for s in servers]})
        with Traffic(servers[0], per_tick=1), Traffic(servers[1], per_tick=2), Traffic(servers[2], per_tick=3):
            prom.wait_for('count(rate(vllm:request_success_total{job="vllm"}[5s]) > 0) == 3', timeout_s=30)
            time.sleep(6)
            src = fleet_source(prom, servers[0].target)
            o = src.observe(time.time())
            assert isinstance(o, Observation), o
            assert 2 <= o.arrival_rate_rps <= 6  # this replica: 4 req/s nominal
            assert 16 <= o.fleet_arrival_rate_rps <= 32  # 4 + 8 + 12 req/s nominal
            assert o.fleet_replicas == 3
            assert 0 < o.fleet_arrival_rate_long_rps <= 32  # the long window, for the fleet's trend
            servers[2].set_mode("http500")  # a replica down (restarting): its series go stale
            prom.wait_for(
                'count(count by (instance) (rate(vllm:request_success_total{job="vllm"}[5s]))) == 2', timeout_s=30
            )
            o = src.observe(time.time())
            assert o.fleet_replicas == 2 and o.fleet_arrival_rate_rps < 16
    finally:
        for s in servers:
            s.stop()


@pytest.mark.prometheus
def test_a_failing_fleet_query_leaves_the_fleet_unknown_not_the_observation(fake_vllm, prometheus_server):
    prom = prometheus_server({"vllm": [fake_vllm.target]})
    with Traffic(fake_vllm):
        prom.wait_for("sum(rate(vllm:request_success_total[5s])) > 0", timeout_s=30)
        own = PrometheusSource(prom.url, 'model_name="tiny"', rate_window_s=5, acceptance_window_s=10, long_window_s=20)
        broken = FleetSource(own, own, 'job=~"["', rate_window_s=5)  # invalid regex: a query error
        o = broken.observe(time.time())
        assert isinstance(o, Observation) and o.arrival_rate_rps > 0
        assert o.fleet_arrival_rate_rps is None and o.fleet_replicas is None


def test_priced_for_fleet_sets_replicas_only_when_measured():
    cfg = Settings(calibration_file=LEGACY_CALIBRATION).policy
    obs = Observation(time_s=0.0, arrival_rate_rps=2.0, fleet_arrival_rate_rps=8.0, fleet_replicas=4)
    assert priced_for_fleet(cfg, obs).replicas == 4
    assert priced_for_fleet(cfg, Observation(time_s=0.0, arrival_rate_rps=2.0)) is cfg


class Fixed:
    """A source that sees the same thing every tick."""

    def __init__(self, obs):
        self.obs = obs

    def observe(self, now):
        return self.obs


def test_a_switch_in_a_fleet_of_four_is_priced_as_one_replicas_dip():
    def cost(**fleet):
        obs = Observation(
            time_s=0.0, arrival_rate_rps=3.0, arrival_rate_long_rps=3.0, mean_prompt_tokens=512,
            mean_gen_tokens=256, sample_age_s=1.0, **fleet,
        )  # fmt: skip
        ctl = Controller(
            Settings(calibration_file=LEGACY_CALIBRATION, replicas=1), MODEL, Fixed(obs), NoHook(),
            clock=lambda: 1_800_000_000.0, registry=CollectorRegistry(),
        )  # fmt: skip
        return ctl.tick().assessment.switch_cost_request_s

    alone, fleet = cost(), cost(fleet_arrival_rate_rps=12.0, fleet_replicas=4)
    assert 0 < fleet < alone / 10, (fleet, alone)  # a dip the others absorb, not an outage


def test_a_fleet_selector_needs_prometheus():
    s = load_settings(calibration_file=LEGACY_CALIBRATION, prometheus_fleet_selector='job="vllm"')
    with pytest.raises(ConfigError, match=r"^setting prometheus_fleet_selector: needs prometheus_url"):
        build_source(s)
    s = load_settings(
        calibration_file=LEGACY_CALIBRATION, prometheus_fleet_selector='job="vllm"', prometheus_url="http://127.0.0.1:9"
    )
    assert isinstance(build_source(s), FleetSource)
