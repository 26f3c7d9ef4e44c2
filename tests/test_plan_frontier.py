"""The menu of trade-offs (Pareto frontier over context x KV type x parallel x GPU layers) and
--prefer: no entry on the menu is dominated, every dropped setting is, pins hold, and each
preference picks the entry its documentation names."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import layerplan
from layerplan import profile_builtin
from layerplan.frontier import MenuEntry, dominates, frontier, pareto, plan_menu, prefer
from layerplan.placement import place
from layerplan.settings import PlanSettings
from localrun.cli.main import app


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))


def entry(ctx, kv="f16", par=1, decode=10.0, **kw) -> MenuEntry:
    fields = dict(n_gpu_layers=0, n_cpu_moe=0, decode_tok_s_total=decode * par, prefill_tok_s=100.0,
                  gpu_bytes=0, host_bytes=0)
    fields.update(kw)
    return MenuEntry(ctx, kv, par, decode_tok_s=decode, **fields)


entries = st.builds(entry, ctx=st.sampled_from([1024, 2048, 4096, 8192]), kv=st.sampled_from(["f16", "q8_0", "q4_0"]),
                    par=st.sampled_from([1, 2, 4]), decode=st.floats(1, 100))


@settings(max_examples=300, deadline=None)
@given(st.lists(entries, max_size=30))
def test_the_frontier_holds_no_dominated_entry_and_drops_only_dominated_ones(items):
    front = pareto(items)
    assert set(front) <= set(items)
    for kept in front:
        assert not any(dominates(other, kept) for other in items)
    for dropped in set(items) - set(front):
        assert any(dominates(other, dropped) for other in items)
    assert bool(front) == bool(items)


def test_dominance_by_hand():
    assert dominates(entry(8192, decode=10), entry(4096, decode=10))         # more context, same speed
    assert not dominates(entry(8192, decode=9), entry(4096, decode=10))      # more context, slower: a trade
    assert dominates(entry(4096, "f16", decode=10), entry(4096, "q8_0", decode=10.05))  # within 1%: f16 wins
    assert not dominates(entry(4096, "f16", decode=10), entry(4096, "q8_0", decode=11))
    assert not dominates(entry(4096, par=1, decode=20), entry(4096, par=2, decode=12))


MENU = [entry(4096, "f16", 1, 40.0), entry(8192, "q8_0", 1, 40.2), entry(32768, "q8_0", 1, 30.0),
        entry(32768, "f16", 1, 25.0), entry(4096, "f16", 4, 20.0), entry(8192, "q8_0", 4, 18.0)]


def test_prefer_picks_as_documented():
    # speed: 40.0 and 40.2 tie within 1%; the larger context (8192) wins
    assert prefer(MENU, "speed") == MENU[1]
    # context: 32k twice; the faster (q8_0, 30 tok/s) wins over the more precise one
    assert prefer(MENU, "context") == MENU[2]
    # parallel: 4 sequences twice; the larger total throughput (4 x 20 = 80 against 72) wins
    assert prefer(MENU, "parallel") == MENU[4]
    assert prefer([], "speed") is None
    with pytest.raises(ValueError, match="--prefer takes"):
        prefer(MENU, "cheap")


def machine(vram="24GiB"):
    return layerplan.build_machine(vram=[vram], ram="64GiB", probe_gpus=False)


def test_real_frontier_fits_and_is_a_frontier():
    p, m = profile_builtin("llama3.1-8b:q4_k_m"), machine("12GiB")
    menu = frontier(p, m, PlanSettings(n_ctx=4096), prompt_tokens=512)
    assert len(menu) >= 2
    for e in menu:
        settings_ = PlanSettings(n_ctx=e.n_ctx, kv_type=e.kv_type, n_parallel=e.n_parallel)
        placed = place(p, m, settings_, e.n_gpu_layers)
        assert placed.fits and sum(u.total_bytes for u in placed.usage[:-1]) == e.gpu_bytes
        assert not any(dominates(o, e) for o in menu)
    # the trade the menu exists for: a longer context costs GPU layers, so speed
    longest = max(menu, key=lambda e: (e.n_ctx, e.n_parallel))
    fastest = max(menu, key=lambda e: e.decode_tok_s)
    assert longest.n_gpu_layers < fastest.n_gpu_layers and longest.decode_tok_s < fastest.decode_tok_s


def test_pins_hold_on_the_menu_and_prefer_changes_only_free_axes():
    p, m = profile_builtin("llama2-7b:f16"), machine()
    pinned = plan_menu(p, m, n_ctx=16384, n_parallel=2, preference="speed")
    assert {(e.n_ctx, e.n_parallel) for e in pinned.menu} == {(16384, 2)}
    assert pinned.settings.n_ctx == 16384 and pinned.settings.n_parallel == 2
    best = max(pinned.menu, key=lambda e: e.decode_tok_s)
    assert (pinned.settings.kv.name, pinned.n_gpu_layers) == (best.kv_type, best.n_gpu_layers)
    assert pinned.reasons[0].startswith("--prefer speed picks 16384 tokens x 2 sequences")
    free = plan_menu(p, m, kv_type="f16", preference="context")
    assert {e.kv_type for e in free.menu} == {"f16"}
    assert free.settings.n_ctx == max(e.n_ctx for e in free.menu)


def test_cli_json_carries_the_menu_and_refuses_a_bad_preference():
    args = ["plan", "llama2-7b:f16", "--vram", "24GiB", "--ram", "64GiB", "--ctx", "16384", "--parallel", "2"]
    data = json.loads(CliRunner().invoke(app, args + ["--json"], catch_exceptions=False).output.strip().splitlines()[-1])
    assert data["schema_version"] == 2 and data["preference"] is None
    assert [(e["ctx"], e["parallel"]) for e in data["menu"]] == [(16384, 2)] * len(data["menu"]) and data["menu"]
    assert {"kv_type", "n_gpu_layers", "decode_tok_s", "prefill_tok_s", "gpu_bytes", "host_bytes"} <= set(data["menu"][0])
    table = CliRunner().invoke(app, args, catch_exceptions=False).output
    assert "Menu: trade-offs that fit" in table
    from localrun.errors import UserError
    with pytest.raises(UserError, match="--prefer takes speed, context, parallel"):
        CliRunner().invoke(app, args + ["--prefer", "cheap"], catch_exceptions=False)
