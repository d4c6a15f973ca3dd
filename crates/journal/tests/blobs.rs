//! Large events by reference: data above `INLINE_MAX` goes to `kedge_blobs`, the journal
//! message carries `data_ref`, and every read puts the data back.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use kedge_core::event::StepCompleted;
use kedge_core::ids::{DecisionSeq, InputId};
use kedge_core::{
    DecisionEnvelope, Draft, Envelope, Event, EventType, InputEnvelope, RunId, StepNo,
};
use kedge_journal::blob::{INLINE_MAX, MAX_BLOB};
use kedge_journal::{BlobError, BlobRef, DecisionWriter, ErrorKind, Journal};

/// A tool result of `size` bytes (see `common::long_tool_result`).
fn big_result(run: &RunId, size: usize) -> InputEnvelope {
    long_tool_result(run, 1, 0, size)
}

/// The raw stored message at `seq` (what a `nats stream get` shows).
async fn raw(journal: &Journal, seq: u64) -> async_nats::jetstream::message::StreamMessage {
    let js = async_nats::jetstream::new(journal.client().clone());
    let stream = js.get_stream("KEDGE_RUNS").await.unwrap();
    stream.get_raw_message(seq).await.unwrap()
}

async fn started(journal: &Journal) -> (RunId, DecisionSeq) {
    let run = new_run();
    let a = journal
        .append_decisions(
            &DecisionWriter::unfenced(&run, "intake"),
            DecisionSeq::NONE,
            &[run_created(&run)],
        )
        .await
        .unwrap();
    (run, a.last_decision())
}

#[tokio::test]
async fn a_ten_mib_input_and_a_two_mib_decision_go_by_reference_and_read_back_whole() {
    let (_server, journal) = setup().await;
    let (run, created) = started(&journal).await;

    // A 2 MiB model response in a decision group, and a 10 MiB tool result.
    let completed = step_completed(&run, 1);
    let mut event = completed.event.clone();
    if let Event::StepCompleted(StepCompleted { message, .. }) = &mut event {
        message.text = "é".repeat(1024 * 1024); // 2 MiB of UTF-8
    }
    let completed = DecisionEnvelope::try_from(Envelope::new(
        run.clone(),
        completed.at,
        Draft::new(event).step(StepNo(1)),
    ))
    .unwrap();
    let group = vec![completed.clone(), tool_requested(&run, 1, 0)];
    let g = journal
        .append_decisions(&DecisionWriter::unfenced(&run, "step"), created, &group)
        .await
        .unwrap();
    let result = big_result(&run, 10 * 1024 * 1024);
    let seq = journal
        .append_input(&InputId::arbitrary("big-1"), &result)
        .await
        .unwrap();
    assert!(!seq.duplicate);
    let seq = seq.seq;
    // A retried append of the same input is still one event (the blob is not stored twice).
    let again = journal
        .append_input(&InputId::arbitrary("big-1"), &result)
        .await
        .unwrap();
    assert!(again.duplicate, "{again:?}");
    assert_eq!(again.seq, seq);

    // What is stored is small and names its blob by the envelope's digest.
    for (at, envelope) in [
        (g.first_seq, completed.envelope()),
        (seq, result.envelope()),
    ] {
        let m = raw(&journal, at).await;
        assert!(
            m.payload.len() < INLINE_MAX,
            "stored {} bytes",
            m.payload.len()
        );
        let stored: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        assert!(stored.get("data").is_none(), "{stored}");
        let reference: BlobRef = serde_json::from_value(stored["data_ref"].clone()).unwrap();
        assert_eq!(reference.digest, envelope.digest);
        assert_eq!(reference.media_type, "application/json");
        // The blob is an ordinary object named by the digest.
        let bytes = journal.blobs().get(&run, &reference).await.unwrap();
        assert_eq!(bytes.len() as u64, reference.size);
        // A consumer's copy of the message opens to the whole event.
        assert_eq!(journal.open(&m.payload).await.unwrap(), *envelope);
    }

    // Reads, pages, typed reads, last-of lookups and tails see whole events.
    let read = journal.read(&run, 0).await.unwrap();
    let types: Vec<EventType> = read.iter().map(|r| r.envelope.event_type()).collect();
    assert_eq!(
        types,
        [
            EventType::RunCreated,
            EventType::StepCompleted,
            EventType::ToolRequested,
            EventType::ToolResult
        ]
    );
    assert_eq!(read[1].envelope, *completed);
    assert_eq!(read[3].envelope, *result);
    let page = journal.read_at_most(&run, 0, 2).await.unwrap();
    assert_eq!(page.events.len(), 2);
    assert!(page.more);
    assert_eq!(page.events[1].envelope, *completed);
    let typed = journal
        .read_type(&run, EventType::ToolResult)
        .await
        .unwrap();
    assert_eq!(typed[0].envelope, *result);
    let last = journal
        .last_of(&run, &[EventType::StepCompleted, EventType::ToolResult])
        .await
        .unwrap();
    assert_eq!(last.len(), 2);
    assert_eq!(last[1].envelope, *result);
    let last_event = journal.last_event(&run).await.unwrap().unwrap();
    assert_eq!(last_event.envelope.as_ref(), Some(result.envelope()));
    let tailed: Vec<_> = tokio::time::timeout(
        Duration::from_secs(20),
        journal.tail(&run, 0).take(4).collect::<Vec<_>>(),
    )
    .await
    .unwrap();
    assert_eq!(tailed[3].as_ref().unwrap().envelope, *result);
}

#[tokio::test]
async fn a_reference_to_a_missing_or_forged_blob_is_set_aside_not_fatal() {
    let (_server, journal) = setup().await;
    let (run, _) = started(&journal).await;
    let client = journal.client().clone();
    let result = big_result(&run, 100 * 1024);
    let data = serde_json::to_vec(&result.event.data_json()).unwrap();
    let stored = |reference: BlobRef| {
        let mut v = serde_json::to_value(result.envelope()).unwrap();
        let map = v.as_object_mut().unwrap();
        map.remove("data");
        map.insert("data_ref".into(), serde_json::to_value(reference).unwrap());
        serde_json::to_vec(&v).unwrap()
    };
    let js = async_nats::jetstream::new(client.clone());
    let publish = |payload: Vec<u8>| {
        let js = js.clone();
        let subject = result.subject();
        async move {
            js.publish(subject, payload.into())
                .await
                .unwrap()
                .await
                .unwrap()
        }
    };
    // Missing: never stored (the result's own blob is stored below, and a reference to it
    // resolves whoever wrote it: content addressing).
    let missing = BlobRef {
        digest: kedge_core::event::Digest::of_bytes(b"never stored"),
        size: data.len() as u64,
        media_type: "application/json".into(),
    };
    publish(stored(missing.clone())).await;
    // Too large to follow.
    publish(stored(BlobRef {
        size: MAX_BLOB + 1,
        ..missing.clone()
    }))
    .await;
    // A blob that is stored but holds other data than the envelope's digest says.
    let other = journal
        .blobs()
        .put(
            &run,
            br#"{"content":"forged","is_error":false,"stopped":false}"#,
            "application/json",
        )
        .await
        .unwrap();
    publish(stored(other)).await;
    // And a good one after them.
    journal
        .append_input(&InputId::arbitrary("good"), &result)
        .await
        .unwrap();

    let page = journal.read_with_set_aside(&run, 0).await.unwrap();
    assert_eq!(page.events.len(), 2, "run.created and the good result");
    assert_eq!(page.events[1].envelope, *result);
    assert_eq!(page.set_aside.len(), 3, "{:?}", page.set_aside);
    assert!(page.set_aside[0].reason.contains("is not in kedge_blobs"));
    assert!(page.set_aside[1].reason.contains("more than"));
    assert!(
        page.set_aside[2].reason.contains("digest"),
        "{}",
        page.set_aside[2].reason
    );
    // A consumer's copy of a forged message does not open.
    let m = raw(&journal, page.set_aside[0].seq).await;
    let err = journal.open(&m.payload).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid);
}

#[tokio::test]
async fn small_events_stay_inline() {
    let (_server, journal) = setup().await;
    let (run, _) = started(&journal).await;
    let result = big_result(&run, INLINE_MAX / 2);
    let seq = journal
        .append_input(&InputId::arbitrary("small"), &result)
        .await
        .unwrap()
        .seq;
    let m = raw(&journal, seq).await;
    let stored: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
    assert!(stored.get("data_ref").is_none());
    assert_eq!(Envelope::from_json_bytes(&m.payload).unwrap(), *result);
}

#[tokio::test]
async fn blobs_belong_to_their_run_and_are_deleted_with_it() {
    let (_server, journal) = setup().await;
    let (run, _) = started(&journal).await;
    let (other, _) = started(&journal).await;
    let result = big_result(&run, 100 * 1024);
    let seq = journal
        .append_input(&InputId::arbitrary("r"), &result)
        .await
        .unwrap()
        .seq;
    let stored: serde_json::Value =
        serde_json::from_slice(&raw(&journal, seq).await.payload).unwrap();
    let reference: BlobRef = serde_json::from_value(stored["data_ref"].clone()).unwrap();
    let blobs = journal.blobs();
    assert!(blobs.get(&run, &reference).await.is_ok());
    // Named by its run: another run cannot borrow it.
    assert_eq!(
        blobs.get(&other, &reference).await.unwrap_err(),
        BlobError::Missing(reference.digest.clone())
    );
    blobs.delete(&run, &reference.digest).await.unwrap();
    assert_eq!(
        blobs.get(&run, &reference).await.unwrap_err(),
        BlobError::Missing(reference.digest.clone())
    );
    blobs.delete(&run, &reference.digest).await.unwrap();
    // The bucket keeps nothing of it: no chunk, no info.
    let js = async_nats::jetstream::new(journal.client().clone());
    let info = js
        .get_stream("OBJ_kedge_blobs")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.state.messages, 0, "{:?}", info.state);
    // A reference to a deleted blob is set aside.
    let page = journal.read_with_set_aside(&run, 0).await.unwrap();
    assert_eq!(page.events.len(), 1);
    assert_eq!(page.set_aside.len(), 1);
}
