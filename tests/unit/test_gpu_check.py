"""benchmarks/gpu_check.sh: ``--dry-run`` runs every part of the GPU check on tiny shapes on the CPU
and its results come out as one table (the script is checked without a GPU); the table reports
per run the kernel path, warm-up apart from steady speed, the compiled graphs, and for a part
stopped by its time limit what it reached."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import table  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(900)  # 40 CPU-seconds, 2 min at load 9 on 2 cores; five processes, each importing torch
def test_gpu_check_dry_run_prints_one_table(tmp_path):
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path), HYBRIDTRAIN_MAMBA_KERNELS="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=850).stdout
    rcs = {p.stem: p.read_text().split()[0] for p in tmp_path.glob("*.rc")}
    assert rcs and all(v == "rc=0" for v in rcs.values()), (rcs, out)
    # the caches of every part live under OUT
    assert (tmp_path / "cache").is_dir()
    for row in ("| nano8 |", "| nano8_torch_eager |", "| dense2b |", "| hf_nano8 (transformers) |",
                "| decode batch 1 |", "| decode batch 2 |"):
        line = out.split(row)[1].split("\n")[0]
        assert "| ok |" in line and " s" in line, (row, out)  # done, with its warm-up seconds
    nano8 = out.split("| nano8 |")[1].split("\n")[0]
    assert "first step" in nano8 and "tok/s" in nano8
    assert "top 30 operators/kernels by self CPU time" in out


def _write(out: Path, name: str, log: str, rc: str) -> None:
    (out / f"{name}.log").write_text(log)
    (out / f"{name}.rc").write_text(rc)


def test_the_table_shows_paths_warm_up_graphs_and_what_a_stopped_part_reached(tmp_path, capsys):
    part = {"status": "done", "wall_s": 200.0, "warmup_start_s": 20.0, "steps_done": 8,
            "step_s": [150.0, 3.0, 0.5, 0.35, 0.35, 0.35, 0.35, 0.35], "compile_s": 70.5,
            "unique_graphs": 6, "graph_breaks": 0, "pre_hook_kernels": ["_chunk_scan_bwd_dx_kernel"]}
    log = ("2026-11-28 INFO hybridtrain.recipes.benchmark: kernel paths: ssd=mamba_ssm 2.3.2 Triton "
           "(custom op); state_update=mamba_ssm 2.3.2; conv=causal_conv1d 1.6.0; loss=Liger 0.8.5, x; "
           "attention=flex_attention (compiled blocks)\n"
           "Triton autotuning for function _chunk_scan_fwd_kernel,\nwith key as (128,),\n"
           "finished after 41.50s,\nbest config selected: x;\n"
           "Triton autotuning for function _chunk_state_fwd_kernel,\nfinished after 20.25s,\n"
           "Triton autotuning for function _chunk_scan_bwd_dx_kernel,\nwith key as (128, 64),\n"
           "finished after 30.00s,\nbest config selected: y;\n"
           "REACHED training step 8 at 200.0 s\nPART " + json.dumps(part) + "\n")
    _write(tmp_path, "nano8", log, "rc=0 limit=183\n")
    bench = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "options": {"warmup_steps": 3},
             "runs": [{"tokens_per_s": 70000.0, "tflops_per_device": 333.3, "mfu": 0.337, "peak_memory_gb": 30.2}]}
    (tmp_path / "nano8.json").write_text(json.dumps(bench))
    stopped = ("REACHED training step 1 at 90.0 s\nREACHED training step 2 at 95.0 s\n"
               "REACHED the time limit at 97.0 s after 2 training step(s)\n"
               "PART " + json.dumps({**part, "status": "timed out", "step_s": [70.0, 5.0], "steps_done": 2}) + "\n")
    _write(tmp_path, "dense2b", stopped, "rc=124 limit=97\n")
    table.main(str(tmp_path))
    out = capsys.readouterr().out
    nano8 = out.split("| nano8 |")[1].split("\n")[0]
    assert ("ssd=mamba_ssm 2.3.2 Triton; state_update=mamba_ssm 2.3.2; conv=causal_conv1d 1.6.0; "
            "loss=Liger 0.8.5; attention=flex_attention") in nano8
    # the kernels whose configs carry a pre_hook, tuned again in every part, apart
    assert ("153.5 s (first step 150.0 s; compile 70.5 s; autotune 91.8 s, 30.0 s of it pre_hook kernels "
            "tuned again in every part)") in nano8
    assert "70,000 tok/s" in nano8 and "333.3 TFLOP/s, MFU 0.337" in nano8
    assert "6 graphs, 0 breaks" in nano8 and "| ok |" in nano8 and "H100" in nano8
    dense = out.split("| dense2b |")[1].split("\n")[0]
    assert "unknown" in dense  # no kernel paths line
    assert "out of time (limit 97 s); reached: the time limit at 97.0 s after 2 training step(s)" in dense
    assert "75.0 s (first step 70.0 s; compile 70.5 s; autotune 0.0 s)" in dense  # no pre_hook kernel tuned
    # parts that never ran say so
    assert "| nano8_torch_eager |" in out and "reached nothing" in out.split("| nano8_torch_eager |")[1].split("\n")[0]
