pub(crate) async fn run(_s: &crate::ConfigSource, _a: BenchArgs, _j: bool) -> Result<(), crate::AnyError> { Ok(()) }
#[derive(Debug, clap::Args)] pub(crate) struct BenchArgs {}
