//! Helpers shared by this crate's integration tests.
#![allow(dead_code)]

pub mod components;
pub mod procs;
pub mod script;
pub mod threads;
