"""`localrun top`: planned (the engine's memory ledger) against actual (the process's RSS) memory,
from a server's /metrics text."""
from prometheus_client.parser import text_string_to_metric_families  # noqa: F401  (the parser top uses)

from localrun.cli import top

METRICS = """# TYPE localrun_memory_planned_bytes gauge
localrun_memory_planned_bytes{device="CPU",part="weights, memory-mapped"} 96468992.0
localrun_memory_planned_bytes{device="CPU",part="KV pool (512 x 1 tokens)"} 11796480.0
localrun_memory_planned_bytes{device="CPU",part="tokenizer (vocabulary and tables)"} 22971648.0
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 137363456.0
"""


class FakeResponse:
    status_code = 200
    text = METRICS


def test_planned_against_actual(monkeypatch):
    import httpx
    monkeypatch.setattr(httpx, "get", lambda *a, **k: FakeResponse())
    now = top.scrape("http://x")
    assert len(now[top.PLANNED_METRIC]) == 3
    label, text = top.memory_row(now)
    planned = 96468992 + 11796480 + 22971648          # 125.2 MiB
    assert text.startswith(f"{planned / 2**20:,.0f} MiB planned / {137363456 / 2**20:,.0f} MiB resident")
    assert f"({137363456 / planned:.2f}x)" in text and "KV pool (512 x 1 tokens) 11" in text


def test_no_memory_row_without_the_metrics():
    assert top.memory_row({"localrun_kv_blocks_used": 3}) is None
