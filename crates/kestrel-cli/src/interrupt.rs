//! The process's one SIGINT/SIGTERM/SIGHUP handler.
//!
//! Every signal first deletes the temporary files of downloads in progress, so an
//! interrupted pull leaves nothing behind. Then the process exits with 130, unless a
//! command has asked to handle interrupts itself (chat stops the answer being generated):
//! then the first signal only raises [`interrupted`], and a second one exits.

use std::sync::atomic::{AtomicBool, Ordering};

static HANDLED_BY_COMMAND: AtomicBool = AtomicBool::new(false);
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Installs the handler; call once, first thing.
pub fn install() {
    let result = ctrlc::set_handler(|| {
        kestrel_hub::remove_partials();
        if !HANDLED_BY_COMMAND.load(Ordering::SeqCst) || INTERRUPTED.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
    });
    if let Err(e) = result {
        eprintln!("kestrel: cannot install the signal handler: {e}");
    }
}

/// From now on the first signal only sets [`interrupted`]; a second one exits.
pub fn handle_in_command() {
    HANDLED_BY_COMMAND.store(true, Ordering::SeqCst);
}

/// Whether a signal came since the last [`clear`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

pub fn clear() {
    INTERRUPTED.store(false, Ordering::SeqCst);
}
