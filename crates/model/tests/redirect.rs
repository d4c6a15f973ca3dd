//! The model client follows no redirect: a model endpoint answering 3xx cannot carry the API key
//! to another host.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kedge_core::event::{ModelSpec, Provider};
use kedge_core::fold::ChatMessage;
use kedge_core::ids::{Attempt, ModelRequestId, RunId, StepNo};
use kedge_model::{ModelCall, ModelClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A server that counts the connections it gets (and answers nothing useful).
async fn elsewhere() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let _ = socket
                .write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
                .await;
        }
    });
    (format!("http://{addr}"), hits)
}

/// A model endpoint that redirects every request to `target`.
async fn redirecting(target: String) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let _ = socket.read(&mut buf).await;
                let answer = format!(
                    "HTTP/1.1 307 Temporary Redirect\r\nlocation: {target}/v1/chat/completions\r\n\
                     content-length: 0\r\n\r\n"
                );
                let _ = socket.write_all(answer.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_redirect_is_an_error_and_the_key_goes_nowhere_else() {
    let (target, hits) = elsewhere().await;
    let base = redirecting(target).await;
    for provider in [Provider::Openai, Provider::Anthropic] {
        let spec = ModelSpec {
            provider,
            name: "m".into(),
            base_url: Some(format!("{base}/v1")),
            settings: Default::default(),
            price: None,
        };
        let run: RunId = "run_redirect".parse().expect("run id");
        let id = ModelRequestId::new(&run, StepNo(1), Attempt(1));
        let context = [ChatMessage::User { text: "hi".into() }];
        let call = ModelCall {
            spec: &spec,
            api_key: Some("sk-secret"),
            system: "test",
            tools: &[],
            context: &context,
            request_id: &id,
            max_output_tokens: 16,
            output_schema: None,
            timeout: Duration::from_secs(5),
        };
        let result = ModelClient::new().complete(&call, &mut |_| {}).await;
        assert!(result.is_err(), "{provider:?}: a 307 is not an answer");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(hits.load(Ordering::SeqCst), 0, "the redirect was followed");
}
