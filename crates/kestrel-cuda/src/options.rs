//! The backend's operational settings, read from the environment once when a backend
//! starts. Only what an operator may need to change lives here (memory use, graph replay,
//! profiling, libraries and driver features to leave out); kernel variants are compared
//! across builds (`scripts/gpu.sh build-base` + `decode-ab`), not switched at run time.
//!
//! | variable | default | effect |
//! |---|---|---|
//! | `KESTREL_CUDA_GRAPHS=0` | on | decode steps run launch by launch instead of replayed as CUDA graphs |
//! | `KESTREL_CUDA_PROFILE=1` | off | time every launch, print a per-kernel table at exit (graphs off) |
//! | `KESTREL_CUDA_CUBLAS=0` | on | no cuBLAS: prompt-sized products on the `matmul` kernel |
//! | `KESTREL_CUDA_PDL=0` | on (sm_90+) | no programmatic dependent launch |
//! | `KESTREL_CUDA_Q8=0` | on | no 8-bit activations: f32 activations everywhere, as the CPU backend computes |
//! | `KESTREL_CUDA_F16_WEIGHTS=0/1` | by free memory | f16 copies of the quantized weights never / always |
//! | `KESTREL_CUDA_MMW=0` | by free memory | no 4-bit repacked copies of Q4_K gate/up (`mmw_gated`) |
//! | `KESTREL_CUDA_READ_AHEAD=0` | on | logit rows are not copied to the host while their product runs |

use std::sync::atomic::{AtomicBool, Ordering};

static PROFILE_REQUESTED: AtomicBool = AtomicBool::new(false);

/// Makes backends created from now on time every launch and print a per-kernel table
/// (time per step, share, GB/s of the GEMVs' weights) when dropped, as
/// `KESTREL_CUDA_PROFILE=1` does; graphs are off while profiling.
pub fn request_profile() {
    PROFILE_REQUESTED.store(true, Ordering::Relaxed);
}

/// Whether to keep f16 copies of quantized weights for prompt-sized cuBLAS products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F16Copies {
    /// When the copy still leaves room for the KV cache (see `leaves_room_for_cache`).
    ByMemory,
    Always,
    Never,
}

/// Settings read once at start (see the module's table).
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub graphs: bool,
    pub profile: bool,
    pub cublas: bool,
    pub pdl: bool,
    pub q8: bool,
    pub f16_copies: F16Copies,
    pub mmw_copies: bool,
    pub read_ahead: bool,
}

impl Options {
    /// The settings of the process's environment.
    pub fn from_env() -> Options {
        Options::from_lookup(|name| std::env::var(name).ok())
    }

    /// The settings `var` gives (a variable's value, None when unset).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Options {
        let is = |name: &str, value: &str| var(name).as_deref() == Some(value);
        let profile = PROFILE_REQUESTED.load(Ordering::Relaxed) || is("KESTREL_CUDA_PROFILE", "1");
        Options {
            graphs: !profile && !is("KESTREL_CUDA_GRAPHS", "0"),
            profile,
            cublas: !is("KESTREL_CUDA_CUBLAS", "0"),
            pdl: !is("KESTREL_CUDA_PDL", "0"),
            q8: !is("KESTREL_CUDA_Q8", "0"),
            f16_copies: match var("KESTREL_CUDA_F16_WEIGHTS").as_deref() {
                Some("0") => F16Copies::Never,
                Some("1") => F16Copies::Always,
                _ => F16Copies::ByMemory,
            },
            mmw_copies: !is("KESTREL_CUDA_MMW", "0"),
            read_ahead: !is("KESTREL_CUDA_READ_AHEAD", "0"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(vars: &[(&str, &str)]) -> Options {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        Options::from_lookup(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn defaults_turn_everything_on() {
        let o = of(&[]);
        assert!(o.graphs && o.cublas && o.pdl && o.q8 && o.mmw_copies && o.read_ahead);
        assert_eq!(o.f16_copies, F16Copies::ByMemory);
    }

    #[test]
    fn each_variable_turns_its_setting_off() {
        assert!(!of(&[("KESTREL_CUDA_GRAPHS", "0")]).graphs);
        assert!(!of(&[("KESTREL_CUDA_CUBLAS", "0")]).cublas);
        assert!(!of(&[("KESTREL_CUDA_PDL", "0")]).pdl);
        assert!(!of(&[("KESTREL_CUDA_Q8", "0")]).q8);
        assert!(!of(&[("KESTREL_CUDA_MMW", "0")]).mmw_copies);
        assert!(!of(&[("KESTREL_CUDA_READ_AHEAD", "0")]).read_ahead);
        assert_eq!(
            of(&[("KESTREL_CUDA_F16_WEIGHTS", "0")]).f16_copies,
            F16Copies::Never
        );
        assert_eq!(
            of(&[("KESTREL_CUDA_F16_WEIGHTS", "1")]).f16_copies,
            F16Copies::Always
        );
        // Other values keep the default.
        assert!(of(&[("KESTREL_CUDA_GRAPHS", "1")]).graphs);
        assert_eq!(
            of(&[("KESTREL_CUDA_F16_WEIGHTS", "x")]).f16_copies,
            F16Copies::ByMemory
        );
    }

    #[test]
    fn profiling_turns_graphs_off() {
        let o = of(&[("KESTREL_CUDA_PROFILE", "1")]);
        assert!(o.profile && !o.graphs);
    }
}
