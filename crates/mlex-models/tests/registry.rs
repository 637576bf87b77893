//! The registry: everything we register is listed; a duplicate name fails
//! loudly naming both origins; unknown names say what exists.

use mlex_core::arch::{Architecture, ModelPlan};
use mlex_core::config::ModelConfig;
use mlex_core::error::{Error, Result};
use mlex_core::registry::Registry;
use mlex_testkit::assert_mentions;
use std::sync::Arc;

/// A second `llama`, registered only in this test binary.
struct ImpostorLlama;

impl Architecture for ImpostorLlama {
    fn name(&self) -> &str {
        "llama"
    }
    fn summary(&self) -> &str {
        "a duplicate for the test"
    }
    fn plan(&self, config: &ModelConfig) -> Result<ModelPlan> {
        Err(config.error("model_type", "never built"))
    }
}

mlex_core::register_architecture!("llama", ImpostorLlama);

#[test]
fn a_duplicate_registration_fails_naming_both_origins() {
    // The impostor comes from inventory, the real `llama` from its spec.
    match mlex_models::build_registry(&[]) {
        Err(Error::DuplicateRegistration {
            what,
            name,
            first,
            second,
        }) => {
            assert_eq!(what, "architecture");
            assert_eq!(name, "llama");
            let origins = [first.as_str(), second.as_str()];
            assert!(origins.contains(&"architectures/llama.toml"), "{origins:?}");
            assert!(
                origins.iter().any(|o| o.starts_with("registry")),
                "{origins:?}"
            );
        }
        Err(other) => panic!("unexpected error: {other}"),
        Ok(_) => panic!("a duplicate `llama` must be rejected"),
    }
    let msg = mlex_models::build_registry(&[]).err().unwrap().to_string();
    assert!(msg.contains("duplicate architecture `llama`"), "{msg}");
}

#[test]
fn adding_a_taken_layer_or_mixer_kind_name_is_an_error() {
    let mut r = Registry::new();
    r.add_layer_kind(Arc::new(mlex_models::block::BlockKind), "first")
        .unwrap();
    let e = r
        .add_layer_kind(Arc::new(mlex_models::block::BlockKind), "second")
        .unwrap_err();
    assert!(
        e.to_string().contains("first") && e.to_string().contains("second"),
        "{e}"
    );
    // A spec names mixers and layer kinds alike: one name, one thing.
    let mamba = || Arc::new(mlex_models::layers::mamba2::Mamba2Kind);
    r.add_mixer_kind(mamba(), "third").unwrap();
    let e = r.add_mixer_kind(mamba(), "fourth").unwrap_err().to_string();
    assert_mentions(&e, &["third", "fourth"]);
    struct Named;
    impl mlex_core::layer::LayerKind for Named {
        fn name(&self) -> &'static str {
            "mamba2"
        }
        fn state(&self) -> mlex_core::layer::StateKind {
            mlex_core::layer::StateKind::None
        }
        fn summary(&self) -> &'static str {
            ""
        }
        fn build(
            &self,
            _: &mut mlex_core::layer::BuildCtx<'_>,
        ) -> mlex_core::error::Result<Box<dyn mlex_core::layer::Layer>> {
            unreachable!()
        }
    }
    let e = r
        .add_layer_kind(Arc::new(Named), "fifth")
        .unwrap_err()
        .to_string();
    assert_mentions(&e, &["third", "fifth"]);
}

#[test]
fn unknown_names_list_what_is_registered() {
    let mut r = Registry::new();
    r.add_mixer_kind(
        Arc::new(mlex_models::layers::attention::AttentionKind),
        "here",
    )
    .unwrap();
    r.add_layer_kind(Arc::new(mlex_models::block::BlockKind), "here")
        .unwrap();
    let (file, text) = mlex_models::spec::BUILTIN[0];
    mlex_models::add_toml_architecture(&mut r, text, std::path::Path::new(file)).unwrap();
    let e = r.architecture("gpt9").err().unwrap().to_string();
    assert_mentions(&e, &["gpt9", "llama"]);
    let e = r.layer_kind("fancy").err().unwrap().to_string();
    assert!(e.contains("unknown layer kind `fancy`"), "{e}");
}
