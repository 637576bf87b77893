//! Tokenizers from GGUF metadata and from tokenizer.json, chat templates,
//! and streaming detokenization that never splits a character (SmolLM2's
//! byte-level BPE vocabulary).

use mlex_generate::{Message, StreamingDetokenizer, Tokenizer};
use mlex_testkit::*;

fn smollm2() -> Tokenizer {
    let f = fixture("smollm2-gguf");
    let g = mlex_models::gguf::load(&path_of(&f)).unwrap();
    Tokenizer::from_gguf(&g.tokenizer).unwrap()
}

#[test]
fn streaming_detokenization_never_splits_a_character() {
    let tok = smollm2();
    let text = "Grüße aus Köln! 東京は晴れ。🌍🚀 naïve café — ok";
    let ids = tok.encode(text, false).unwrap();
    // Byte-level BPE spreads multi-byte characters over several tokens.
    let lone: Vec<String> = ids.iter().map(|&i| tok.decode(&[i]).unwrap()).collect();
    assert!(
        lone.iter().any(|s| s.contains('\u{FFFD}')),
        "the text must exercise split characters"
    );
    let mut d = StreamingDetokenizer::new(&tok);
    let mut pieces = Vec::new();
    for &i in &ids {
        pieces.push(d.push(i).unwrap());
    }
    pieces.push(d.finish().unwrap());
    for p in &pieces {
        assert!(!p.contains('\u{FFFD}'), "emitted a broken character: {p:?}");
    }
    assert_eq!(pieces.concat(), tok.decode(&ids).unwrap());
    assert_eq!(pieces.concat(), text);
}

#[test]
fn gguf_tokenizer_knows_its_special_tokens_and_template() {
    let tok = smollm2();
    let im_end = tok.token_to_id("<|im_end|>").expect("special token");
    assert!(
        tok.eos_ids.contains(&im_end),
        "the chat template's end token stops generation"
    );
    // Special-token text is matched as one token.
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(ids[0], tok.token_to_id("<|im_start|>").unwrap());
    assert_eq!(*ids.last().unwrap(), im_end);
    let t = tok.chat_template.as_ref().expect("GGUF chat template");
    let with_system = t
        .render(
            &[
                Message::new("system", "Answer in French."),
                Message::new("user", "Hello"),
            ],
            true,
        )
        .unwrap();
    assert!(
        with_system.contains("Answer in French.")
            && with_system.ends_with("<|im_start|>assistant\n"),
        "{with_system}"
    );
}

#[test]
fn tokenizer_json_directory_gives_the_same_ids() {
    let tok = smollm2();
    let dir = tempfile::tempdir().unwrap();
    tok.save_json(&dir.path().join("tokenizer.json")).unwrap();
    let template = tok.chat_template_source().unwrap().to_owned();
    let cfg = serde_json::json!({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"});
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let from_dir = Tokenizer::from_dir(dir.path()).unwrap();
    for text in [
        "What is the capital of France?",
        "<|im_start|>assistant\nÇa va? 🌍",
    ] {
        assert_eq!(
            from_dir.encode(text, false).unwrap(),
            tok.encode(text, false).unwrap(),
            "{text}"
        );
    }
    assert!(from_dir
        .eos_ids
        .contains(&from_dir.token_to_id("<|im_end|>").unwrap()));
    let msgs = [Message::new("user", "Hi")];
    assert_eq!(
        from_dir
            .chat_template
            .as_ref()
            .unwrap()
            .render(&msgs, true)
            .unwrap(),
        tok.chat_template
            .as_ref()
            .unwrap()
            .render(&msgs, true)
            .unwrap()
    );
    // A broken tokenizer.json names the file.
    std::fs::write(dir.path().join("tokenizer.json"), "{ not json").unwrap();
    let e = Tokenizer::from_dir(dir.path()).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}

/// A chat template that does not compile, or that fails to render, is an
/// error naming the file it came from.
#[test]
fn a_broken_chat_template_names_its_file() {
    let tok = smollm2();
    let dir = tempfile::tempdir().unwrap();
    tok.save_json(&dir.path().join("tokenizer.json")).unwrap();
    let write = |template: &str| {
        let cfg = serde_json::json!({"chat_template": template, "eos_token": "<|im_end|>"});
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    };
    write("{% for m in messages %}{{ m.content }");
    let e = Tokenizer::from_dir(dir.path())
        .err()
        .expect("rejected")
        .to_string();
    assert_mentions(&e, &["tokenizer_config.json", "does not compile"]);
    write("{{ raise_exception('only user turns here') }}");
    let t = Tokenizer::from_dir(dir.path()).unwrap();
    let e = t
        .chat_ids(&[Message::new("user", "Hi")], true)
        .expect_err("fails to render")
        .to_string();
    assert_mentions(&e, &["tokenizer_config.json", "only user turns here"]);
}

/// A SentencePiece GGUF vocabulary (`tokenizer.ggml.model = llama`, scores
/// and no merges) tokenizes as transformers' GGUF loader does: ids and
/// decoded text recorded by `xtask/py/fixtures.py` from transformers itself.
#[test]
fn a_sentencepiece_gguf_vocabulary_tokenizes_as_transformers_does() {
    let f = fixture("gguf-llama-spm-q8_0");
    let g = mlex_models::gguf::load(&path_of(&f)).unwrap();
    assert_eq!(g.tokenizer.model, "llama");
    let tok = Tokenizer::from_gguf(&g.tokenizer).unwrap();
    let dir = path_of(&f);
    let dir = dir.parent().unwrap();
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("tokenizer_reference.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(tok.add_bos, reference["add_bos"].as_bool().unwrap());
    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        // The reference puts BOS first; mlex adds it only when the text
        // does not already begin with it (as mlx-lm does), so compare the
        // text's own tokens.
        assert_eq!(want[0], tok.bos_id.unwrap());
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, want[1..], "ids of {text:?}");
        assert_eq!(
            tok.decode(&want).unwrap(),
            case["decoded"].as_str().unwrap(),
            "decoding {text:?}"
        );
    }
}

/// The one text stream of every front end: what it shows while tokens
/// arrive is a prefix of the text, never part of a stop string, and never a
/// split character; a stop string cuts the text where it starts, even when
/// it spans tokens; at the end the held-back tail comes out, and after a
/// cut nothing more does.
#[test]
fn the_text_stream_shows_safe_prefixes_and_cuts_at_stop_strings() {
    use mlex_generate::{Finish, TextStream};
    let tok = smollm2();
    let text = "Grüße aus Köln! The answer is STOP here, naïve café.";
    let ids = tok.encode(text, false).unwrap();
    let want = &text[..text.find("STOP").unwrap()];

    let mut s = TextStream::new(&tok, vec!["STOP".into(), String::new()]);
    let mut shown = String::new();
    let mut stopped_at = None;
    for (i, &t) in ids.iter().enumerate() {
        let p = s.push(t).unwrap();
        assert!(
            !p.text.contains('\u{FFFD}'),
            "a split character: {:?}",
            p.text
        );
        shown.push_str(&p.text);
        assert!(want.starts_with(&shown), "showed {shown:?}");
        if p.stop {
            stopped_at = Some(i);
            break;
        }
    }
    let at = stopped_at.expect("the stop string ends the text");
    assert!(at < ids.len() - 1, "it stopped before the last token");
    shown.push_str(&s.finish(Finish::Stop).unwrap());
    assert_eq!(shown, want);
    assert_eq!(s.text(), want);
    // Nothing after the cut, even if tokens keep coming.
    let after = s.push(ids[at + 1]).unwrap();
    assert!(after.stop && after.text.is_empty());

    // Without a stop string everything comes out, in the same pieces a
    // plain detokenizer gives, and the end adds nothing more.
    let mut s = TextStream::new(&tok, Vec::new());
    let mut all = String::new();
    for &t in &ids {
        let p = s.push(t).unwrap();
        assert!(!p.stop);
        all.push_str(&p.text);
    }
    all.push_str(&s.finish(Finish::Length).unwrap());
    assert_eq!(all, text);

    // A stop string that never comes: its possible start is held back until
    // the end, then shown.
    let mut s = TextStream::new(&tok, vec!["café!".into()]);
    let mut shown = String::new();
    for &t in &ids {
        shown.push_str(&s.push(t).unwrap().text);
    }
    assert!(
        text.starts_with(&shown) && shown.len() < text.len(),
        "{shown:?}"
    );
    shown.push_str(&s.finish(Finish::Eos).unwrap());
    assert_eq!(shown, text);
}
