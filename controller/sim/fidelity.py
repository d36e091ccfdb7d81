"""Model fidelity the way a user would measure it: bench → calibrate → load test → validate.

The truth is the step-level simulation (:mod:`controller.sim.stepsim`, costs from
:mod:`controller.sim.gpu`), which shares no code or parameters with the latency model. The
controller reaches it only through the :class:`~controller.benchmark.probe.BenchServer`
protocol: micro-benchmarks of an SD-off server and SD servers at several draft lengths are
written to CSV, read back and calibrated exactly as ``sd-controller bench`` /
``sd-controller calibrate`` would; constant-rate load tests of the same servers are written to
CSV and compared by :func:`controller.validation.validate`.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from controller import calibration as cal_mod
from controller.benchmark import csvio
from controller.benchmark.loadtest import LoadPlan, MakeRequests, run_load
from controller.benchmark.micro import TILE_PHASE_TOKENS, MicroPlan, run_micro
from controller.benchmark.probe import ProbeRequest
from controller.sim.gpu import H100_SXM, LLAMA_3_1_8B, LLAMA_3_2_1B, GpuSpec, ModelSpec
from controller.sim.simserver import SimulatedServer
from controller.sim.stepsim import ServerSpec
from controller.sim.truth_workloads import poisson_load
from controller.validation import ValidationReport, validate


@dataclass(frozen=True)
class TruthServer:
    """The simulated deployment: one target, one draft, one GPU, vLLM's defaults."""

    target: ModelSpec = LLAMA_3_1_8B
    draft: ModelSpec = LLAMA_3_2_1B
    gpu: GpuSpec = H100_SXM
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    noise_sigma: float = 0.02
    # A preempted request's blocks stay cached and its readmission hits them (vLLM's prefix
    # caching); off in the stored runs (stepsim's docstring).
    cache_preempted_blocks: bool = False

    def spec(self, draft_length: int) -> ServerSpec:
        return ServerSpec(
            target=self.target,
            draft=self.draft if draft_length > 0 else None,
            gpu=self.gpu,
            draft_length=draft_length,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            noise_sigma=self.noise_sigma,
            cache_preempted_blocks=self.cache_preempted_blocks,
        )


# Every 8 sequences (vLLM's CUDA-graph sizes are multiples of 8): places the treads of the
# decode step's staircase, which the calibration keeps (calibration.decode_staircase).
EVERY_8 = (1, 2, 4, *range(8, 257, 8))


@dataclass(frozen=True)
class BenchSettings:
    """What the user measures: the micro-benchmark plan per server."""

    draft_lengths: tuple[int, ...] = (2, 4)
    # Not only powers of two: GEMMs run in whole tiles (and waves), so batches that fill them
    # exactly are the cheapest; sizes in between let the fit see the average cost. The shipped
    # calibrations were measured on these; bench_fidelity.py benches EVERY_8.
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 100, 128, 150, 176, 200, 232, 256)
    prompt_tokens: int = 512
    gen_tokens: int = 256
    context_prompt_tokens: tuple[int, ...] = (2048,)
    chunk_tokens: tuple[int, ...] = (128, 512, 1024, 2048, 4096)
    iterations: int = 3
    seed: int = 1
    # Decode runs with no all-decode step run again longer (micro.decode_together); off only to
    # reproduce the shipped truth calibration, benched before it.
    rerun_staggered: bool = True
    # Mixed-run chunks walk the GEMM tiles' phases (micro.tile_phase_offset); 0 only to
    # reproduce a bench from before it (the shipped truth calibration, the stored fidelity runs
    # before stop 44).
    chunk_phase_tokens: int = TILE_PHASE_TOKENS


@dataclass(frozen=True)
class LoadSettings:
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0)
    duration_s: float = 600.0
    workloads: tuple[str, ...] = ("chat", "code", "mixed", "long_prompt")
    draft_lengths: tuple[int, ...] = (0, 2, 4)
    seed: int = 7


@dataclass
class FidelityRun:
    calibration: cal_mod.CalibrationFile
    reports: dict[str, ValidationReport] = field(default_factory=dict)
    load_rows: dict[str, list[cal_mod.LoadRow]] = field(default_factory=dict)


def measure_and_calibrate(
    truth: TruthServer, bench: BenchSettings, workdir: Path, log: Callable[[str], None] | None = None
) -> cal_mod.CalibrationFile:
    """Micro-benchmark every server into CSVs and calibrate from the files (as a user would)."""
    paths = []
    for gamma in (0, *bench.draft_lengths):
        server = SimulatedServer(truth.spec(gamma), seed=bench.seed + gamma)
        # Mixed steps on the SD server too: the draft prefills prompt chunks in its first pass,
        # and only a long chunk shows its attention over the chunk (quadratic in its length).
        phases = ("prefill", "target", "mixed") if gamma == 0 else ("prefill", "verify", "mixed")
        plan = MicroPlan(
            phases=phases,
            batch_sizes=bench.batch_sizes,
            prompt_tokens=bench.prompt_tokens,
            gen_tokens=bench.gen_tokens,
            iterations=bench.iterations,
            chunk_tokens=bench.chunk_tokens,
            context_prompt_tokens=bench.context_prompt_tokens,
            rerun_staggered=bench.rerun_staggered,
            chunk_phase_tokens=bench.chunk_phase_tokens,
        )
        rows = run_micro(server, plan)
        path = workdir / f"bench-g{gamma}.csv"
        path.write_text(csvio.bench_csv(rows), encoding="utf-8")
        paths.append(path)
        if log:
            log(f"bench γ={gamma}: {len(rows)} rows -> {path.name}")
    rows, digest = cal_mod.read_bench_csvs(paths)
    meta = cal_mod.Metadata(
        gpu=f"{truth.gpu.name} (simulated: controller/sim/gpu.py roofline)",
        target_model=truth.target.name,
        draft_model=truth.draft.name,
        vllm_version="simulated vLLM v1 scheduler (controller/sim/stepsim.py)",
        source_file=",".join(p.name for p in paths),
        source_sha256=digest,
    )
    return cal_mod.calibrate(
        rows,
        warmup=0,
        max_num_seqs=truth.max_num_seqs,
        max_num_batched_tokens=truth.max_num_batched_tokens,
        metadata=meta,
        where="fidelity bench",
    )


def truth_requests(workload: str) -> MakeRequests:
    """A truth workload (truth_workloads.poisson_load) as a load test's ``make_requests``."""

    def make(rate: float, duration: float, rng: random.Random) -> list[ProbeRequest]:
        return poisson_load(rate, duration, workload, np.random.default_rng(rng.randrange(2**32)))

    return make


def load_test(
    truth: TruthServer, load: LoadSettings, workload: str, workdir: Path, log: Callable[[str], None] | None = None
) -> list[cal_mod.LoadRow]:
    """Constant-rate load tests of every mode on one workload, through a load-test CSV."""
    rows_all = []
    for gamma in load.draft_lengths:
        server = SimulatedServer(truth.spec(gamma), seed=load.seed + 31 * gamma)
        plan = LoadPlan(
            rates=load.rates,
            duration_s=load.duration_s,
            drain_s=max(60.0, 0.5 * load.duration_s),
            workload=workload,
            seed=load.seed,
            max_requests=100_000,
        )
        rows_all.extend(run_load(server, truth_requests(workload), plan))
        if log:
            log(f"load {workload} γ={gamma}: {len(rows_all)} rows so far")
    path = workdir / f"load-{workload}.csv"
    path.write_text(csvio.load_csv(rows_all), encoding="utf-8")
    rows, _ = cal_mod.read_load_csv(path)
    return rows


def run(
    truth: TruthServer = TruthServer(),
    bench: BenchSettings = BenchSettings(),
    load: LoadSettings = LoadSettings(),
    workdir: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> FidelityRun:
    """The whole pipeline; CSVs and the calibration land in ``workdir`` (a temp dir if None)."""
    with tempfile.TemporaryDirectory() as tmp:
        wd = Path(workdir or tmp)
        wd.mkdir(parents=True, exist_ok=True)
        cal = measure_and_calibrate(truth, bench, wd, log)
        cal_mod.save(cal, wd / "calibration.json")
        out = FidelityRun(cal)
        model = cal.latency_model()
        for workload in load.workloads:
            rows = load_test(truth, load, workload, wd, log)
            out.load_rows[workload] = rows
            out.reports[workload] = validate(model, rows)
        return out
