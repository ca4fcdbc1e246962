//! ferry's ibverbs backend. All raw verbs calls live in [`verbs`].

pub mod verbs;
