//! The backend's own thread pool for its parallel loops.
//!
//! A decode step runs ~200 short parallel loops (one per matmul, 30–300 µs each). Through
//! rayon each one is injected from the (non-pool) calling thread, which then sleeps while
//! the workers are woken: two futex wake-ups per loop, ~20–40 µs on this kind of VM, most
//! of a small matmul. Here the calling thread takes part in its own loop and the workers
//! spin for a while after each loop before they sleep, so a loop that follows soon after
//! the last one starts at once (llama.cpp's threads do the same).
//!
//! Each thread takes its own contiguous share of a loop's tasks in order (one sequential
//! stream of weight rows per core, which the hardware prefetchers follow; tasks handed out
//! alternately from one counter ran 13% slower), then takes the others' remaining tasks
//! from their ends, so a slow or descheduled thread only delays the task it holds; a loop
//! is finished when all its tasks are, whether or not every worker woke up for it.
//! Results do not depend on which thread runs a task.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker spins for the next loop before it sleeps.
const SPIN: Duration = Duration::from_millis(2);

/// A task body: called with task indices `0..n_tasks`.
type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Bumped for every loop: what sleeping and spinning workers watch.
    generation: AtomicU64,
    /// Per thread (the caller is 0): its contiguous share of the current loop's tasks,
    /// `front << 32 | back`, claimed from the front by its owner and from the back by
    /// threads that ran out of their own. All are empty between loops.
    ranges: Vec<AtomicU64>,
    /// Tasks of the current loop finished.
    finished: AtomicUsize,
    /// The current loop's body, valid while a task of it is unfinished.
    job: UnsafeCell<*const Job>,
    /// A task panicked.
    panicked: AtomicBool,
    /// Workers asleep (or going to sleep) on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread holding `Pool::busy`, while every range is
// empty (the previous loop finished), before it fills the ranges (release); workers read
// it only after claiming a task from a range (acquire), and the loop does not return
// while that task is unfinished.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    workers: usize,
    /// Held by the thread running a loop; another caller meanwhile runs its loop alone.
    busy: Mutex<()>,
}

/// The pool, sized to rayon's thread count (`-t`) when first used: that many threads
/// including the caller.
pub fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::new(rayon::current_num_threads().max(1)))
}

/// Loops of more tasks than this run on the caller alone (ranges hold 32-bit indices).
const MAX_TASKS: usize = u32::MAX as usize;

impl Pool {
    /// A pool of `threads` threads, the caller of [`Pool::run`] included.
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            ranges: (0..threads).map(|_| AtomicU64::new(0)).collect(),
            finished: AtomicUsize::new(0),
            job: UnsafeCell::new(std::ptr::null::<fn(usize)>() as *const Job),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = threads - 1;
        for i in 1..threads {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("kestrel-cpu-{i}"))
                .spawn(move || worker(&s, i))
                .expect("spawn a CPU worker thread");
        }
        Pool {
            shared,
            workers,
            busy: Mutex::new(()),
        }
    }

    /// Threads a loop can use.
    pub fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Calls `f(i)` for every `i` in `0..n_tasks`, on the pool's threads and the caller's,
    /// and returns when all calls have returned. Each thread starts on its own contiguous
    /// share of the indices, in order (so each streams its own part of a weight matrix),
    /// then helps with the others' from their ends. A panic in `f` is raised here.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        let guard = if self.workers == 0 || n_tasks == 1 || n_tasks > MAX_TASKS {
            None
        } else {
            self.busy.try_lock().ok()
        };
        let Some(_guard) = guard else {
            // One task, no workers, or the pool busy with another caller's loop.
            (0..n_tasks).for_each(f);
            return;
        };
        let s = &*self.shared;
        // SAFETY: the previous loop finished, so every range is empty and no worker reads
        // `job` until a range is filled below. The pointer is valid until this function
        // returns, which waits for every task to finish.
        unsafe {
            *s.job.get() = std::mem::transmute::<&(dyn Fn(usize) + Sync), *const Job>(f);
        }
        s.finished.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        let threads = s.ranges.len();
        for (t, r) in s.ranges.iter().enumerate() {
            let (a, b) = (n_tasks * t / threads, n_tasks * (t + 1) / threads);
            r.store(((a as u64) << 32) | b as u64, Ordering::Release);
        }
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        // The caller works too; its own panic waits for the workers' tasks to finish.
        let mine = catch_unwind(AssertUnwindSafe(|| run_tasks(s, 0)));
        let mut spins = 0u32;
        while s.finished.load(Ordering::Acquire) < n_tasks {
            spins += 1;
            if spins < 1 << 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a CPU worker task panicked");
        }
    }
}

/// Claims one task of `range`: its front (the owner) or its back (a helper).
fn claim(range: &AtomicU64, front: bool) -> Option<usize> {
    let mut cur = range.load(Ordering::Acquire);
    loop {
        let (a, b) = (cur >> 32, cur & 0xffff_ffff);
        if a >= b {
            return None;
        }
        let (next, task) = if front {
            (((a + 1) << 32) | b, a)
        } else {
            ((a << 32) | (b - 1), b - 1)
        };
        match range.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(task as usize),
            Err(now) => cur = now,
        }
    }
}

/// Runs thread `me`'s tasks of the current loop, then the others' until none are left.
fn run_tasks(s: &Shared, me: usize) {
    let n = s.ranges.len();
    let run = |i: usize| {
        // SAFETY: task `i` is claimed and unfinished, so its loop has not returned and
        // `job` points to the loop's body.
        let f = unsafe { &**s.job.get() };
        if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.finished.fetch_add(1, Ordering::Release);
    };
    while let Some(i) = claim(&s.ranges[me], true) {
        run(i);
    }
    for k in 1..n {
        let other = &s.ranges[(me + k) % n];
        while let Some(i) = claim(other, false) {
            run(i);
        }
    }
}

fn worker(s: &Shared, me: usize) {
    let mut seen = s.generation.load(Ordering::Acquire);
    loop {
        // Spin for the next loop, then sleep.
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let generation = s.generation.load(Ordering::Acquire);
            if generation != seen {
                seen = generation;
                break;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(256) && start.elapsed() > SPIN {
                let mut l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                loop {
                    let generation = s.generation.load(Ordering::SeqCst);
                    if generation != seen {
                        seen = generation;
                        break;
                    }
                    l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
        }
        run_tasks(s, me);
    }
}

/// A pointer that tasks writing disjoint elements of one buffer may share.
pub(crate) struct SharedMut<T>(pub(crate) *mut T);
impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}
// SAFETY: only used to write disjoint elements from different tasks.
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The element pointer at `offset` (a method, so closures capture the whole
    /// `SharedMut`, which is `Send`, not its raw pointer field).
    ///
    /// # Safety
    /// `offset` must lie inside the buffer.
    pub(crate) unsafe fn at(self, offset: usize) -> *mut T {
        // SAFETY: in bounds by the caller's guarantee.
        unsafe { self.0.add(offset) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        let pool = Pool::new(3);
        for n in [0usize, 1, 2, 3, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
        // After the workers went to sleep.
        std::thread::sleep(SPIN * 3);
        let sum = AtomicUsize::new(0);
        pool.run(50, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 49 * 50 / 2);
    }

    #[test]
    fn concurrent_callers_and_panics() {
        let pool = Pool::new(2);
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    for _ in 0..200 {
                        let sum = AtomicUsize::new(0);
                        pool.run(64, &|i| {
                            sum.fetch_add(i, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 63 * 64 / 2);
                    }
                });
            }
        });
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(10, &|i| assert!(i != 7, "task 7"));
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let sum = AtomicUsize::new(0);
        pool.run(10, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }
}
