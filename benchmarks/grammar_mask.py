"""Structured output's cost: compiling a schema, and masking one token, against a decode step.

On the default model (SmolLM2-135M, 49,152 tokens), one run:
1. compile: a typical 10-field schema (strings, integers with bounds, a number, a boolean, an
   enum, an array, a nested object, a nullable field) compiled cold (a fresh compiler, so no
   cache), best of --repeats. Also the one-off cost of reading the vocabulary into the grammar
   engine (once per model, at the first structured request).
2. mask: for each token of a valid 10-field instance, compute the mask, apply it to a logits
   row (-inf outside it) and consume the token: the per-token work sampling adds. Mean over
   the instance's tokens, best of --repeats.
3. decode step: the engine's greedy decode on the same model, ms per token (a 64-token
   unconstrained generation: 1 / decode_tok_s), best of --repeats; and the same engine
   generating under the schema (end to end: its decode tok/s with the mask on).
   mask_over_decode = mask ms per token / decode ms per token (the issue's target: <= 10%).

Candidates other than the one localrun uses (llguidance) are measured too when importable
(outlines-core: compile and per-token allowed-set; xgrammar needs transformers, not installed
by set-up). Prints a table, then one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

SCHEMA = {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "id": {"type": "integer"},
        "note": {"type": ["string", "null"]}},
    "required": ["name", "age", "email", "active", "score", "tags", "role", "address", "id", "note"],
    "additionalProperties": False}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": True, "score": 9.5,
            "tags": ["math", "poetry"], "role": "admin", "address": {"city": "London", "zip": "W1"}, "id": 7,
            "note": None}


def best(fn, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def measure_llguidance(tokenizer, eog, ids, n_vocab: int, repeats: int) -> dict:
    from localrun.grammar import GrammarCompiler
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, eog)
    vocab_s = time.perf_counter() - t0

    def compile_once() -> float:
        compiler.clear_cache()                                  # cold: compiled from the schema
        t = time.perf_counter()
        compiler.json_schema(SCHEMA).new_matcher()
        return time.perf_counter() - t
    compile_s = best(compile_once, repeats)
    constraint = compiler.json_schema(SCHEMA)
    logits = torch.randn(n_vocab)

    def mask_once() -> float:
        matcher = constraint.new_matcher()
        t = time.perf_counter()
        for token_id in ids:
            masked = matcher.mask(logits)
            assert masked[token_id] > float("-inf"), "the instance must be allowed"
            matcher.consume(token_id)
        return (time.perf_counter() - t) / len(ids)
    return {"vocab_s": vocab_s, "compile_s": compile_s, "mask_ms": best(mask_once, repeats) * 1000}


def measure_outlines(tokenizer, ids, repeats: int) -> dict | None:
    try:
        from outlines_core import Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    eos = tokenizer.eos_id
    pieces: dict[str, list[int]] = {}
    for i in range(tokenizer.n_vocab):
        if i == eos:
            continue
        try:
            pieces.setdefault(tokenizer.piece(i, special=True).decode("utf-8"), []).append(i)
        except UnicodeDecodeError:
            continue
    vocabulary = Vocabulary(eos, pieces)

    def compile_once() -> float:
        t = time.perf_counter()
        Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
        return time.perf_counter() - t
    compile_s = best(compile_once, repeats)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)

    def mask_once() -> float:
        state = index.get_initial_state()
        t = time.perf_counter()
        for token_id in ids:
            index.get_allowed_tokens(state)
            state = index.get_next_state(state, token_id)
        return (time.perf_counter() - t) / len(ids)
    return {"compile_s": compile_s, "mask_ms": best(mask_once, repeats) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf path or catalog name (default: smollm2-135m)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from localrun.api import LLM
    from localrun.cpu_info import cpu_info
    llm = LLM(args.model, n_ctx=1024, n_parallel=1)
    tokenizer = llm.tokenizer
    # the instance as the mask's own compact JSON spells it
    ids = tokenizer.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special=False)
    lg = measure_llguidance(tokenizer, tokenizer.eog_ids, ids, llm.n_vocab, args.repeats)
    oc = measure_outlines(tokenizer, ids, max(1, args.repeats // 2))

    prompt = llm.chat_prompt_ids([{"role": "user", "content": "Describe a user of a web site as JSON."}])
    decode_tok_s = max(llm.generate(prompt, max_tokens=64, temperature=0, ignore_eos=True).timings["decode_tok_s"]
                       for _ in range(args.repeats))
    # the same length under the schema (64 tokens: the JSON need not be finished)
    schema_tok_s = max(llm.generate(prompt, max_tokens=64, temperature=0, json_schema=SCHEMA).timings["decode_tok_s"]
                       for _ in range(args.repeats))
    decode_ms = 1000 / decode_tok_s
    result = {
        "benchmark": "grammar_mask", "model": llm.model_path.name, "n_vocab": llm.n_vocab,
        "cpu": cpu_info(with_torch=False)["model"],
        "threads": torch.get_num_threads(), "library": "llguidance", "schema_fields": len(SCHEMA["properties"]),
        "instance_tokens": len(ids),
        "compile_s": round(lg["compile_s"], 4), "vocab_load_s": round(lg["vocab_s"], 3),
        "mask_ms_per_token": round(lg["mask_ms"], 4), "decode_ms_per_token": round(decode_ms, 3),
        "mask_over_decode": round(lg["mask_ms"] / decode_ms, 4),
        "decode_tok_s": round(decode_tok_s, 1), "decode_tok_s_with_schema": round(schema_tok_s, 1),
        "schema_decode_slowdown": round(decode_tok_s / schema_tok_s - 1, 4),
        "targets_met": lg["compile_s"] <= 0.5 and lg["mask_ms"] / decode_ms <= 0.10,
        **({"outlines_core_compile_s": round(oc["compile_s"], 4), "outlines_core_allowed_ms_per_token":
            round(oc["mask_ms"], 4)} if oc else {}),
    }
    rows = [("llguidance (used)", f"{lg['compile_s'] * 1000:.1f}", f"{lg['mask_ms']:.3f}",
             f"{100 * lg['mask_ms'] / decode_ms:.2f}%")]
    if oc:
        rows.append(("outlines-core", f"{oc['compile_s'] * 1000:.1f}", f"{oc['mask_ms']:.3f} (ids only)",
                     f"{100 * oc['mask_ms'] / decode_ms:.2f}%"))
    print(f"model {llm.model_path.name}, vocabulary {llm.n_vocab}, decode {decode_ms:.2f} ms/token "
          f"({decode_tok_s:.1f} tok/s; {schema_tok_s:.1f} tok/s under the schema)")
    print(f"{'library':<20} {'compile ms':>11} {'mask ms/token':>20} {'of a decode step':>17}")
    for row in rows:
        print(f"{row[0]:<20} {row[1]:>11} {row[2]:>20} {row[3]:>17}")
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
