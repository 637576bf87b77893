//! Stop strings over text that arrives a token at a time.

/// Where the first stop string starts in `text`, if one appears (the text
/// the user sees is everything before it).
pub fn cut_at_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

/// Bytes of `text` that may be shown while generation goes on: all but the
/// last `longest stop - 1` characters, which could still turn out to begin
/// a stop string.
pub fn shown_len(text: &str, stops: &[String]) -> usize {
    let hold = stops
        .iter()
        .map(|s| s.chars().count())
        .max()
        .unwrap_or(1)
        .saturating_sub(1);
    let mut safe = text.len();
    for _ in 0..hold {
        safe = text[..safe]
            .char_indices()
            .next_back()
            .map(|(i, _)| i)
            .unwrap_or(0);
    }
    safe
}

/// Bytes at the end of `text` that begin one of `markers` without being
/// all of it: they must wait for more text before they can be shown.
pub(crate) fn held_back(text: &str, markers: &[String]) -> usize {
    let mut keep = 0;
    for m in markers {
        for (i, _) in m.char_indices().skip(1) {
            if i > keep && text.ends_with(&m[..i]) {
                keep = i;
            }
        }
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_cut_and_hold_back_a_possible_start() {
        let stops = vec!["END".to_owned(), String::new()];
        assert_eq!(cut_at_stop("abcENDx", &stops), Some(3));
        assert_eq!(cut_at_stop("abc", &stops), None);
        // The last two characters could begin "END"; "aé" is three bytes.
        assert_eq!(shown_len("aéEN", &stops), 3);
        assert_eq!(shown_len("abc", &[]), 3);
    }

    #[test]
    fn only_a_real_start_of_a_marker_is_held_back() {
        let m = vec!["<tool_call>".to_owned(), "</think>".to_owned()];
        assert_eq!(held_back("a < b", &m), 0);
        assert_eq!(held_back("text <tool", &m), 5);
        assert_eq!(held_back("x </", &m), 2);
        assert_eq!(held_back("x <", &m), 1);
        assert_eq!(held_back("<tool_call>", &m), 0);
    }
}
