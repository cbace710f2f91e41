from evaluation.plots import plot_learning_curve


def point(n, length, rates):
    return {"conversations": n, "acceptance": {"mean_acceptance_length": length, "acceptance_rate_per_pos": rates}}


def test_learning_curve_plot_draws_cpu_and_gpu_runs_and_the_anchor(tmp_path):
    cpu = {"device": "cpu", "device_name": "cpu", "points": [point(500, 1.2, [0.2, 0.02, 0.0]),
                                                            point(2000, 1.33, [0.29, 0.04, 0.005])]}
    gpu = {"device": "cuda", "device_name": "NVIDIA H200", "goal": {"acceptance_length": 2.1},
           "points": [point(8000, 1.6, [0.45, 0.12, 0.03]), point(500, 1.25, [0.22, 0.03, 0.0])]}
    empty = {"device": "cuda", "points": []}  # a run killed before its first point draws nothing
    anchor = {"label": "anchor", "conversations": 5000, "acceptance_length": 1.53, "per_position": [0.408, 0.108, 0.016]}
    out = plot_learning_curve([cpu, gpu, empty], tmp_path / "img" / "curve.png", [anchor])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
