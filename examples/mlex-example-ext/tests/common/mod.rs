//! The toy_ext checkpoint the tests share: random weights for
//! `layers` layers alternating `gated_mlp` and `attention` (4 heads).

use mlx_rs::{random, Array};

/// The tensors of a toy_ext model, by checkpoint name.
pub fn toy_tensors(hidden: i32, vocab: i32, layers: i32) -> Vec<(String, Array)> {
    let mut out = Vec::new();
    let mut n = 0;
    let mut rand = |shape: &[i32], scale: f32| {
        n += 1;
        let key = random::key(n).unwrap();
        let a = random::normal::<f32>(shape, None, None, &key).unwrap();
        mlx_rs::ops::multiply(&a, Array::from_f32(scale)).unwrap()
    };
    out.push(("embed.weight".to_owned(), rand(&[vocab, hidden], 0.5)));
    out.push(("norm.weight".to_owned(), rand(&[hidden], 0.1)));
    for i in 0..layers {
        let p = format!("layers.{i}");
        if i % 2 == 0 {
            out.push((format!("{p}.norm.weight"), rand(&[hidden], 1.0)));
            out.push((format!("{p}.up.weight"), rand(&[hidden, hidden], 0.2)));
            out.push((format!("{p}.gate"), rand(&[hidden], 1.0)));
        } else {
            out.push((format!("{p}.input_layernorm.weight"), rand(&[hidden], 1.0)));
            for m in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                out.push((
                    format!("{p}.self_attn.{m}.weight"),
                    rand(&[hidden, hidden], 0.2),
                ));
            }
        }
    }
    out
}
