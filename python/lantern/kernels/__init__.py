"""lantern's Triton kernels, one module per op (the "triton" backend, docs/triton.md). Each module's
``launch`` takes its op's schema arguments (``lantern.ops.<op>_op.SCHEMA``) and launches its kernels;
``lantern.ops.library.Op`` declares ``lantern_triton::<op>`` from it when the backend loads."""
