//! In-process backend: ranks are threads. (Being written.)
