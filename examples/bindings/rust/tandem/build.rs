// Link libtandem without pkg-config: TANDEM_LIB_DIR (the directory holding libtandem.so)
// or TANDEM_PREFIX (an install prefix: PREFIX/lib). With neither, the system linker path.
// An rpath to that directory is added to tests, examples and binaries so they run without
// LD_LIBRARY_PATH.
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=TANDEM_LIB_DIR");
    println!("cargo:rerun-if-env-changed=TANDEM_PREFIX");
    let dir = env::var_os("TANDEM_LIB_DIR").map(PathBuf::from).or_else(|| {
        env::var_os("TANDEM_PREFIX").map(|p| {
            let p = PathBuf::from(p);
            ["lib", "lib64", "lib/x86_64-linux-gnu"]
                .iter()
                .map(|d| p.join(d))
                .find(|d| d.join("libtandem.so").exists())
                .unwrap_or_else(|| p.join("lib"))
        })
    });
    if let Some(dir) = dir {
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
        println!("cargo:lib_dir={}", dir.display());
    }
    println!("cargo:rustc-link-lib=dylib=tandem");
}
