//! Stop strings over streamed text: emits text as soon as it cannot be the start of a
//! stop string, and cuts the output where a stop string begins.

#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds generated text. Returns the text safe to emit now and whether a stop string
    /// was found (the emitted text then ends right before it).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.pending.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Text held back at the end of generation (no stop string followed).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (t, stop) = m.push(p);
            out += &t;
            if stop {
                return (out, true);
            }
        }
        out += &m.finish();
        (out, false)
    }

    #[test]
    fn stop_strings_split_across_pieces_are_found() {
        assert_eq!(
            run(&["END"], &["ab", "cE", "N", "Dxyz"]),
            ("abc".into(), true)
        );
        assert_eq!(run(&["END"], &["ab", "cE", "N"]), ("abcEN".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(
            run(&["\n\n", "##"], &["x\n", "#y", "\n\nz"]),
            ("x\n#y".into(), true)
        );
    }

    #[test]
    fn text_is_held_back_only_while_it_may_start_a_stop() {
        let mut m = StopMatcher::new(&["stop".to_string()]);
        assert_eq!(m.push("hello st"), ("hello ".into(), false));
        assert_eq!(m.push("ar"), ("star".into(), false));
        assert_eq!(m.push("é"), ("é".into(), false));
    }
}
