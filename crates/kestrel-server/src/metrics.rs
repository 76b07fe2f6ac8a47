//! Prometheus text-format metrics: the server's own counters and latency histograms plus
//! the scheduler's gauges.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use kestrel_engine::scheduler::SchedulerHandle;

/// Upper bounds (seconds) of the latency histogram buckets.
const BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Debug, Default)]
pub struct Histogram {
    inner: Mutex<HistogramData>,
}

#[derive(Debug, Default, Clone)]
struct HistogramData {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        let mut h = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = BUCKETS.iter().position(|&b| seconds <= b) {
            h.counts[i] += 1;
        }
        h.count += 1;
        h.sum += seconds;
    }

    pub fn count(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in BUCKETS.iter().zip(h.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "{name}_sum {}", h.sum);
        let _ = writeln!(out, "{name}_count {}", h.count);
    }
}

/// The server's own counters.
#[derive(Debug, Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub requests_rejected: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
}

impl Metrics {
    pub fn render(&self, sched: &SchedulerHandle) -> String {
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let s = sched.stats();
        counter(
            "kestrel_requests_total",
            "Generation requests received.",
            load(&self.requests),
        );
        counter(
            "kestrel_requests_rejected_total",
            "Requests answered with an error status.",
            load(&self.requests_rejected),
        );
        counter(
            "kestrel_prompt_tokens_total",
            "Prompt tokens of accepted requests.",
            load(&self.prompt_tokens),
        );
        counter(
            "kestrel_generation_tokens_total",
            "Tokens sent to clients.",
            load(&self.generated_tokens),
        );
        counter(
            "kestrel_tokens_evaluated_total",
            "Tokens run through the model (prefill, recomputation, decode).",
            load(&s.tokens_evaluated),
        );
        counter(
            "kestrel_prefix_cache_hit_blocks_total",
            "KV blocks reused from the prefix cache.",
            load(&s.prefix_hit_blocks),
        );
        counter(
            "kestrel_prefix_cache_hit_tokens_total",
            "Prompt tokens whose KV came from the prefix cache.",
            load(&s.prefix_hit_tokens),
        );
        counter(
            "kestrel_preemptions_total",
            "Sequences preempted for lack of KV blocks.",
            load(&s.preemptions),
        );
        counter(
            "kestrel_requests_cancelled_total",
            "Requests whose client left before the end.",
            load(&s.requests_cancelled),
        );
        counter("kestrel_steps_total", "Forward steps run.", load(&s.steps));
        counter(
            "kestrel_chained_steps_total",
            "Decode steps queued while the step before ran, their tokens left on the device.",
            load(&s.chained_steps),
        );
        let (drafted, accepted, rounds) = (
            load(&s.spec_drafted),
            load(&s.spec_accepted),
            load(&s.spec_rounds),
        );
        counter(
            "kestrel_spec_drafted_tokens_total",
            "Speculative decoding: draft tokens verified.",
            drafted,
        );
        counter(
            "kestrel_spec_accepted_tokens_total",
            "Speculative decoding: draft tokens accepted.",
            accepted,
        );
        let _ = writeln!(
            out,
            "# HELP kestrel_spec_mean_accepted_length Draft tokens accepted per verification \
             step.\n# TYPE kestrel_spec_mean_accepted_length gauge\n\
             kestrel_spec_mean_accepted_length {:.4}",
            accepted as f64 / rounds.max(1) as f64
        );
        // Where the scheduler thread's time goes (µs counters, reported in seconds).
        let _ = writeln!(
            out,
            "# HELP kestrel_scheduler_seconds_total Scheduler thread time: the model's \
             forward steps, and its own work around them (admission, batching, sampling, \
             sending); \"masks\": the token filters' preparation (grammar masks), on their \
             own thread beside the forward steps; \"mask_wait\": the part of the forward \
             steps spent waiting for those masks once the step was launched.\n\
             # TYPE kestrel_scheduler_seconds_total counter\n\
             kestrel_scheduler_seconds_total{{phase=\"forward\"}} {:.6}\n\
             kestrel_scheduler_seconds_total{{phase=\"host\"}} {:.6}\n\
             kestrel_scheduler_seconds_total{{phase=\"masks\"}} {:.6}\n\
             kestrel_scheduler_seconds_total{{phase=\"mask_wait\"}} {:.6}",
            load(&s.forward_us) as f64 / 1e6,
            load(&s.host_us) as f64 / 1e6,
            load(&s.mask_us) as f64 / 1e6,
            load(&s.mask_wait_us) as f64 / 1e6
        );
        let mut gauge = |name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge(
            "kestrel_queue_length",
            "Requests waiting for admission.",
            load(&s.waiting),
        );
        gauge(
            "kestrel_running_sequences",
            "Sequences being prefilled or decoded.",
            load(&s.running),
        );
        gauge(
            "kestrel_kv_blocks_used",
            "KV blocks held by sequences.",
            load(&s.blocks_used),
        );
        gauge(
            "kestrel_kv_blocks_cached",
            "Idle prefix-cache KV blocks (evictable).",
            load(&s.blocks_cached_idle),
        );
        gauge(
            "kestrel_kv_blocks_free",
            "Free KV blocks.",
            load(&s.blocks_free),
        );
        gauge(
            "kestrel_kv_blocks_total",
            "KV blocks in the cache.",
            sched.info().n_blocks as u64,
        );
        gauge(
            "kestrel_kv_block_size_tokens",
            "Positions one KV block holds.",
            sched.info().block_size as u64,
        );
        gauge(
            "kestrel_kv_cache_bytes_per_token",
            "Bytes of keys and values one cached position takes over all layers.",
            sched.info().kv_bytes_per_token as u64,
        );
        self.ttft.render(
            &mut out,
            "kestrel_time_to_first_token_seconds",
            "Time from request to first token.",
        );
        self.itl.render(
            &mut out,
            "kestrel_inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
        );
        out
    }
}
