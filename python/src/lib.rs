//! Placeholder: the Python extension is being written.
