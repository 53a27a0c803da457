"""What runs an artifact on the deploy host: the TVM runtime, numpy and (for text) `tokenizers`; never
the compiler (`tvm.relax`) or relaxtune's passes."""
