//! Our context made current for one driver call, on any thread, without taking the thread's
//! own context away from it.
//!
//! kvlink's driver calls run on its own threads and on the engine's (a layer wait, an event or
//! buffer dropped there). A call that left kvlink's context current on an engine thread whose
//! own context is another (a non-primary context, another GPU's) would send the engine's next
//! runtime calls to the wrong context. [`Current`] pushes ours over another and pops it again.

use std::marker::PhantomData;

use cudarc::driver::{result, sys, CudaContext, DriverError};

/// `ctx` is current on this thread while the guard lives; a thread that had another current
/// context, or none, has that again when the guard drops (an engine thread that never touched
/// CUDA must not find kvlink's GPU current afterwards: its runtime calls would go there rather
/// than to device 0). The guard borrows the context, so the context
/// outlives it, and is not `Send`: it pops on the thread that pushed.
pub(crate) struct Current<'c> {
    pushed: bool,
    _context: PhantomData<&'c CudaContext>,
    /// Popped on the thread that pushed (a context stack is per thread).
    _not_send: PhantomData<*const ()>,
}

impl<'c> Current<'c> {
    /// Makes `ctx` current for the guard's life.
    pub(crate) fn make(ctx: &'c CudaContext) -> Result<Self, DriverError> {
        let pushed = match result::ctx::get_current()? {
            Some(c) if c == ctx.cu_ctx() => false,
            None | Some(_) => {
                // SAFETY: `ctx.cu_ctx()` is a live context (the `CudaContext` holds it
                // retained, and the guard's borrow keeps that alive until it pops); it is
                // popped once, on this thread, when the guard drops.
                unsafe { sys::cuCtxPushCurrent_v2(ctx.cu_ctx()) }.result()?;
                true
            }
        };
        Ok(Current {
            pushed,
            _context: PhantomData,
            _not_send: PhantomData,
        })
    }

    /// [`make`](Self::make), its failure as the backend's error.
    pub(crate) fn of(ctx: &'c CudaContext) -> Result<Self, crate::DeviceError> {
        Self::make(ctx).map_err(super::error::drv("cuCtxPushCurrent"))
    }
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `make` pushed on this thread (the guard is not `Send`);
        // `popped` is a valid out-pointer.
        if let Err(e) = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }.result() {
            tracing::warn!(
                error = %super::error::driver_error_text(e),
                "cuCtxPopCurrent failed: the thread's own context may not be current"
            );
        }
    }
}

/// The context current on this thread when made, current again when dropped: around cudarc
/// calls that make their own context current for good (`CudaContext::new`, a new stream), so
/// an engine thread that opens kvlink's device keeps its own context.
pub(crate) struct ThreadContext {
    saved: Option<sys::CUcontext>,
    _not_send: PhantomData<*const ()>,
}

impl ThreadContext {
    /// Remembers this thread's current context (none: nothing to give back).
    pub(crate) fn save() -> Result<Self, DriverError> {
        Ok(ThreadContext {
            saved: result::ctx::get_current()?,
            _not_send: PhantomData,
        })
    }
}

impl Drop for ThreadContext {
    fn drop(&mut self) {
        make_current_again(self.saved);
    }
}

/// Makes `saved`, this thread's current context when it was read, current again (if another
/// one replaced it meanwhile); `None`: the thread had none, and has none again (a thread that
/// never touched CUDA must not keep kvlink's context bound: an engine's runtime calls there
/// would go to kvlink's GPU).
fn make_current_again(saved: Option<sys::CUcontext>) {
    let now = result::ctx::get_current().ok().flatten();
    if now == saved {
        return;
    }
    let to = saved.unwrap_or(std::ptr::null_mut());
    // SAFETY: `to` is null (no current context: always valid) or was this thread's current
    // context when it was read (by this thread, moments ago: in the same drop or guard), and
    // whoever made it current keeps it alive while it is (the engine's own context).
    if let Err(e) = unsafe { result::ctx::set_current(to) } {
        tracing::warn!(
            error = %super::error::driver_error_text(e),
            "cuCtxSetCurrent failed: the thread's own context is not current again"
        );
    }
}

/// The **last field** of a value whose fields may hold the last handle on kvlink's context or
/// kernels: cudarc's drops of a context, a module or a stream make that context current with
/// `cuCtxSetCurrent`, replacing the calling thread's own (an engine's). The value's `Drop`
/// calls [`save`](Self::save) first; the fields then drop in order, this one last, and it makes
/// the thread's own context current again, or none where the thread had none.
#[derive(Debug, Default)]
pub(crate) struct ContextRestore {
    /// The thread's current context when `save` ran (an address: the field stays `Send`);
    /// `Some(None)`: it had none; `None`: `save` never ran (nothing to restore).
    saved: Option<Option<usize>>,
}

impl ContextRestore {
    /// Remembers the calling thread's current context, to make it current again on drop.
    /// A failed query remembers nothing (the drop then leaves the thread as it finds it).
    pub(crate) fn save(&mut self) {
        self.saved = result::ctx::get_current()
            .ok()
            .map(|c| c.map(|c| c as usize));
    }
}

impl Drop for ContextRestore {
    fn drop(&mut self) {
        if let Some(saved) = self.saved.take() {
            make_current_again(saved.map(|c| c as sys::CUcontext));
        }
    }
}
