"""The command-line interface end to end (in-process)."""
import json

from kvbridge.cli import main


def test_models_lists_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("llama-3.1-70b", "deepseek-v3", "gemma-4-31b", "nemotron-h-56b", "gpt-oss-120b"):
        assert name in out


def test_plan_json_schema(capsys):
    assert main(["plan", "--model", "gemma-4-31b", "--prefill-tp", "8", "--decode-tp", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prefill"] == {"tp": 8, "pp": 1, "pp_layers": [[0, 60]]}
    assert {g["name"]: g["num_heads"] for g in doc["groups"]} == {"sliding": 16, "full": 4}
    assert len({(r["decode"]["tp"], r["prefill"]["tp"]) for r in doc["reads"]}) == 8
    for r in doc["reads"]:
        assert r["bytes_per_token"] > 0 and r["bytes_per_request"] is None


def test_plan_table_and_drawing(tmp_path, capsys):
    svg = tmp_path / "plan.svg"
    assert main(["plan", "--model", "nemotron-h-56b", "--prefill-tp", "4", "--decode-tp", "2", "--prefill-pp", "2",
                 "--draw", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "mamba" in out and "attn" in out and ("direct" in out or "staged" in out)
    assert svg.read_text().startswith("<svg") and svg.read_text().count("<line") > 0


def test_plan_rejects_impossible_topology_with_fix(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--prefill-tp", "3", "--decode-tp", "2"]) == 2
    out = capsys.readouterr().err
    assert "LayoutError" in out and "tp=3" in out and "divides 8" in out


def test_plan_from_hf_config(capsys):
    from pathlib import Path
    cfg = Path(__file__).parent / "data" / "hf_configs" / "deepseek-v3.json"
    assert main(["plan", "--model", str(cfg), "--prefill-tp", "4", "--decode-tp", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(r["heads"] is None for r in doc["reads"])
    assert len(doc["reads"]) == 8  # one read per decode rank: the latent is replicated


def test_verify_single_and_sweep(capsys):
    assert main(["verify", "--model", "tiny-hybrid", "--prefill-tp", "2", "--decode-tp", "4",
                 "--prefill-layout", "cross_layer", "--decode-block-size", "4"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["verify", "--sweep"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out


def test_plan_cp_token_share_column_and_json(capsys):
    """Context parallelism (issue 21): the table shows each read's token share and each rank's share."""
    argv = ["plan", "--model", "deepseek-v3", "--prefill-tp", "4", "--decode-tp", "4", "--decode-dcp", "4",
            "--decode-cp-interleave", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tokens" in out and "token share per rank" in out
    for k in range(4):
        assert f"{k}/4x16 (25%)" in out and f"t // 16 % 4 == {k}" in out
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decode"]["dcp"] == 4 and doc["decode"]["cp_interleave"] == 16
    assert [x["tokens"]["rank"] for x in doc["decode"]["ranks"]] == [0, 1, 2, 3]
    assert sorted((r["decode"]["tp"], r["prefill"]["tp"], r["tokens"][0]["rank"]) for r in doc["reads"]) == [
        (k, k, k) for k in range(4)]
    assert all(r["token_fraction"] == 0.25 for r in doc["reads"])


def test_plan_pcp_ranks_and_refusal(capsys):
    assert main(["plan", "--model", "tiny-mla", "--prefill-tp", "1", "--prefill-pcp", "2", "--decode-tp", "2",
                 "--decode-dcp", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prefill"]["pcp"] == 2 and [x["tokens"] for x in doc["prefill"]["ranks"]] == [None, None]
    assert {r["prefill"]["tp"] for r in doc["reads"]} == {0, 1}  # the two PCP copies, one per decode rank
    assert main(["plan", "--model", "gemma-4-31b", "--prefill-tp", "8", "--decode-tp", "8", "--decode-dcp", "2"]) == 2
    err = capsys.readouterr().err
    assert "ContextParallelError" in err and "decode_context_parallel_size=2" in err


def test_verify_cp_flags(capsys):
    assert (
        main(
            [
                "verify",
                "--model",
                "tiny-mla",
                "--prefill-tp",
                "2",
                "--prefill-dcp",
                "2",
                "--prefill-block-size",
                "8",
                "--prefill-cp-interleave",
                "4",
                "--decode-tp",
                "3",
                "--decode-dcp",
                "3",
                "--decode-block-size",
                "4",
                "--decode-cp-interleave",
                "2",
                "--requests",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "PASS" in out and "dcp2x4" in out and "dcp3x2" in out


def test_demo_prints_labelled_latency_burst_and_large_request(monkeypatch, capsys):
    """`kvbridge demo` (real rank processes, NIXL): warm single-request latency with the handshake excluded,
    the burst's wall time and throughput apart, and one large request's GB/s against memcpy, each labelled;
    the byte-level verification still decides PASS."""
    import re

    import pytest
    from rich.console import Console

    from kvbridge.testing import demo
    from kvbridge.transport.nixl import nixl_available
    if not nixl_available():
        pytest.skip("nixl not installed")
    monkeypatch.setattr(demo, "console", Console(width=400, force_terminal=False))
    assert main(["demo", "--model", "tiny-dense", "--prefill-tp", "2", "--decode-tp", "1", "--requests", "4",
                 "--max-tokens", "64", "--warm-requests", "3", "--large", "--large-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]

    def row(prefix: str) -> str:
        hits = [v for k, v in rows.items() if k.startswith(prefix)]
        assert len(hits) == 1, (prefix, list(rows))
        return hits[0]

    warm_label = next(k for k in rows if k.startswith("single-request transfer latency, warm"))
    assert "3 requests of 32 tokens" in warm_label and "handshake and first request excluded" in warm_label
    med, mn = map(float, re.fullmatch(r"([0-9.]+) / ([0-9.]+) ms", row("single-request transfer latency")).groups())
    assert 0 < mn <= med
    burst_label = next(k for k in rows if k.startswith("burst wall time"))
    longest = re.search(r"4 requests of up to ([0-9]+) tokens started at once", burst_label)
    assert longest and 1 <= int(longest.group(1)) <= 64 and "not a per-request latency" in burst_label, burst_label
    assert float(re.fullmatch(r"([0-9.]+) ms", row("burst wall time")).group(1)) > 0
    reqs, gbps = re.fullmatch(r"([0-9]+) req/s, ([0-9.]+) GB/s", row("burst throughput")).groups()
    assert int(reqs) > 0
    assert "large request: 4096 tokens" in next(k for k in rows if k.startswith("large request: "))
    got, memcpy, ratio = re.fullmatch(r"([0-9.]+) vs ([0-9.]+) GB/s \(([0-9.]+)x of memcpy\)",
                                      row("large request GB/s vs one-thread numpy memcpy")).groups()
    assert (
        float(got) > 0
        and float(memcpy) > 0
        and abs(float(got) / float(memcpy) - float(ratio)) < 0.01 + 0.01 * float(ratio)
    )
    # beside kvbridge's own latency, NIXL's READ of the same bytes between the same processes
    kv_ms, nixl_ms, diff = re.fullmatch(r"([0-9.]+) vs ([0-9.]+) ms \(([+-][0-9.]+) ms\)",
                                        row("the same single requests timed inside the decode processes")).groups()
    assert float(kv_ms) > 0 and float(nixl_ms) > 0
    assert abs(float(kv_ms) - float(nixl_ms) - float(diff)) < 0.02
    same, one = re.fullmatch(r"([0-9.]+) / ([0-9.]+) GB/s \([0-9]+ / [0-9]+ ms\)",
                             row("NIXL's own READ of the large request's bytes")).groups()
    assert float(same) > 0 and float(one) > 0
    assert "report" in row("large request: where the time went")
    assert row("requests finished / sent (all phases)") == "9 / 9"  # 1 untimed + 3 warm + 4 burst + 1 large
    assert row("mismatched bytes") == "0" and row("leaked transfer handles") == "0"
    assert row("result") == "PASS"
