//! A packed batch (several documents per row, position ids restarting per document)
//! against transformers' packed-sequence path (fixture by scripts/make_packed_fixture.py:
//! transformers 5 finds the documents from the position resets and masks attention
//! block-diagonally; the script checks that this equals every document run alone).
//! Tolerances (f32 both sides): per-token loss and loss sum 5e-6 relative, every
//! parameter's gradient of the summed loss 2e-5 relative (as tests/all/golden.rs).

use candle_core::{safetensors, DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use longctx::attention::{local::LocalAttention, mode::with_docs, AttentionMode, Docs};
use longctx::model::{Llama, LlamaConfig};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(p)
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    longctx_attention::testing::rel_err(a, b).unwrap()
}

/// The model with every parameter a Var, and the fixture.
fn load() -> (Llama, std::collections::HashMap<String, Tensor>) {
    let d = fixture("llama_gqa_bias");
    let cfg = LlamaConfig::from_file(d.join("config.json")).unwrap();
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        for (k, t) in safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap() {
            data.insert(k, Var::from_tensor(&t).unwrap());
        }
    }
    let model = Llama::load(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &cfg).unwrap();
    (model, safetensors::load(fixture("packed_docs/reference.safetensors"), &Device::Cpu).unwrap())
}

fn docs_of(r: &std::collections::HashMap<String, Tensor>) -> Docs {
    let starts: Vec<Vec<i64>> = r["doc_starts"].to_vec2().unwrap();
    let s = starts[0].len();
    Docs::new(starts.into_iter().map(|row| row.into_iter().filter(|&x| x >= 0).map(|x| x as usize).collect()).collect(), s).unwrap()
}

#[test]
fn packed_documents_match_transformers_packed_path() {
    let (model, r) = load();
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    let pos = r["position_ids"].to_dtype(DType::U32).unwrap();
    let base: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let attn = with_docs(&base, Some(docs_of(&r)));
    let (per_tok, n) = model.per_token_loss(&ids, &r["targets"], &pos, &attn).unwrap();
    assert_eq!(n as i64, r["n_tokens"].to_scalar::<i64>().unwrap());
    let e = rel_err(&per_tok, &r["per_token_loss"]);
    assert!(e <= 5e-6, "per-token loss rel err {e:e}");
    let sum = per_tok.sum_all().unwrap();
    assert!(rel_err(&sum, &r["loss_sum"]) <= 5e-6);
    let grads = sum.backward().unwrap();
    for (name, t) in model.named_parameters() {
        let e = rel_err(grads.get(&t).unwrap(), &r[&format!("grad.{name}")]);
        assert!(e <= 2e-5, "grad of {name}: rel err {e:e}");
    }
}

/// The same batch without the document mask (positions still reset) is far off: the
/// fixture tests the mask, not only the positions.
#[test]
fn without_the_mask_the_losses_differ() {
    let (model, r) = load();
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    let pos = r["position_ids"].to_dtype(DType::U32).unwrap();
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let (per_tok, _) = model.per_token_loss(&ids, &r["targets"], &pos, &attn).unwrap();
    assert!(rel_err(&per_tok, &r["per_token_loss"]) > 1e-2);
}
