fn main() {
    eprintln!("longctx: being written");
}
