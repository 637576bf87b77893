//! Chat templates (Jinja, as in Hugging Face `tokenizer_config.json` or the
//! GGUF `tokenizer.chat_template`) rendered with minijinja, with Python
//! string methods (`.strip()`, `.startswith()`, ...) and the helpers HF
//! templates call (`raise_exception`, `strftime_now`).

use minijinja::{context, Environment, ErrorKind, Value};
use mlex_core::error::{Error, Result};
use serde::Serialize;

/// One chat message.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_owned(),
            content: content.to_owned(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: Option<String>,
    eos: Option<String>,
    /// Where the template came from, for errors.
    origin: String,
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(_format: String) -> String {
    // Templates use it for a date line; a fixed, explicit value keeps
    // rendering deterministic (and cached prefixes stable across turns).
    "26 Jul 2024".to_owned()
}

impl ChatTemplate {
    /// Compiles `source`; `bos`/`eos` are exposed as `bos_token`/`eos_token`.
    pub fn new(source: &str, bos: Option<String>, eos: Option<String>) -> Result<Self> {
        Self::from_origin("the chat template", source, bos, eos)
    }

    /// [`new`](Self::new) for a template read from `origin` (a file and
    /// key), which compile and render errors name.
    pub fn from_origin(
        origin: &str,
        source: &str,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| Error::Other(format!("{origin} does not compile: {e}")))?;
        Ok(Self {
            env,
            source: source.to_owned(),
            bos,
            eos,
            origin: origin.to_owned(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`, ending with the assistant's turn opening when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| Error::Other(format!("{}: {e}", self.origin)))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone().unwrap_or_default(),
            eos_token => self.eos.clone().unwrap_or_default(),
            tools => Value::UNDEFINED,
        })
        .map_err(|e| Error::Other(format!("{} failed to render: {e}", self.origin)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'].strip() + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_renders_with_default_system_and_python_methods() {
        let t = ChatTemplate::new(CHATML, None, None).unwrap();
        let out = t
            .render(&[Message::new("user", "  Hi there ")], true)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn explicit_system_prompt_replaces_the_default() {
        let t = ChatTemplate::new(CHATML, None, None).unwrap();
        let out = t
            .render(
                &[
                    Message::new("system", "Be brief."),
                    Message::new("user", "Q"),
                ],
                false,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", None, None).unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }
}
