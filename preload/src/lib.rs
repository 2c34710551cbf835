//! Placeholder: the preload layer is being written.
