//! The CPU device: an implementation of the device traits ([`Device`](crate::Device),
//! [`Stream`](crate::Stream), [`DeviceEvent`](crate::DeviceEvent)) in host memory.
//!
//! It is the backend that runs the device path of the linker in CI, on machines without a GPU:
//! its "device memory" is host memory, each stream is a worker thread that runs its queue in
//! order, and events really order work (an event completes when its stream reaches it; a
//! stream that waits on an event blocks its worker until the event completes). Nothing is
//! simulated about the ordering: a missing wait shows up as wrong bytes or a failed check.
//!
//! For tests it can stall (no stream of the device starts work for a while), delay every
//! operation by a random amount (so streams drift against each other), fail the n-th enqueue of
//! a kind of operation, and record a trace of what each stream ran and when.

mod device;
mod event;
mod stream;

pub use device::{CpuDevice, CpuDeviceConfig, CpuOp, TraceOp};
pub use event::CpuEvent;
