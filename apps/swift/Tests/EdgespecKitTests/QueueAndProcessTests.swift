import Foundation
import XCTest
@testable import EdgespecKit
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// `503 queue_full` from a server that runs one request at a time and queues nothing
/// (`--max-batch 1 --max-queue 0`; a larger batch would take the second request in):
/// mapped with its `Retry-After`, and retried by the bounded policy.
final class QueueFullTests: XCTestCase {
    var reference: Fixture.Reference!
    var server: EdgespecServer!

    override func setUp() async throws {
        reference = try Fixture.reference()
        server = try await Fixture.sharedServer("no-queue", extra: ["--max-batch", "1", "--max-queue", "0"])
    }

    func testBusyServerAnswersQueueFullWithRetryAfter() async throws {
        let client = try server.client(retryPolicy: .none, timeout: 120)
        let prompt = reference.completion.prompt
        var refusal: EdgespecError?
        // One long generation occupies the engine; a second request meanwhile is refused.
        // (Tried a few times in case the first ever finishes before the second arrives.)
        for _ in 0..<5 where refusal == nil {
            let (started, signal) = AsyncStream<Void>.makeStream()
            let long = Task {
                defer { signal.finish() }  // never leave the test waiting if the stream fails early
                for try await chunk in client.streamCompletion(CompletionRequest(prompt: prompt, options: .init(maxTokens: 480)))
                    where !chunk.text.isEmpty
                {
                    signal.yield()
                }
            }
            for await _ in started { break }
            let error = await caught { try await client.complete(CompletionRequest(prompt: prompt, options: .init(maxTokens: 4))) }
            long.cancel()
            _ = await long.result
            if let e = error as? EdgespecError, case .queueFull = e { refusal = e }
            else if let error { throw error }
        }
        guard case .queueFull(let body, let retryAfter)? = refusal else { return XCTFail("never refused") }
        XCTAssertEqual(body.code, "queue_full")
        XCTAssertEqual(retryAfter, 1, "Retry-After: 1")
        XCTAssertEqual(refusal?.status, 503)
        try await eventually("the server is idle again") { try await client.health().queue.running == 0 }
        let health = try await client.health()
        XCTAssertGreaterThanOrEqual(health.queue.refused, 1)
    }

    func testRetryPolicyGetsEveryRequestThrough() async throws {
        // Four at once: one runs, the others are refused and retry after Retry-After
        // (capped at 0.2 s here); each round lets at least one more in.
        let client = try server.client(retryPolicy: RetryPolicy(maxRetries: 40, defaultDelay: 1, maxDelay: 0.2),
                                       timeout: 120)
        let c = reference.completion
        let before = try await client.health().queue
        let texts = try await withThrowingTaskGroup(of: String.self) { group in
            for _ in 0..<4 {
                group.addTask {
                    try await client.complete(CompletionRequest(prompt: c.prompt, options: .init(maxTokens: c.max_tokens))).text
                }
            }
            return try await group.reduce(into: []) { $0.append($1) }
        }
        XCTAssertEqual(texts, Array(repeating: c.text, count: 4))
        let after = try await client.health().queue
        XCTAssertEqual(after.completed, before.completed + 4)
        print("retry policy: \(after.refused - before.refused) refusals retried")
    }
}

/// `EdgespecServer`: starts `edgespec serve`, notices it was killed and restarts it, stops it.
final class ProcessManagerTests: XCTestCase {
    func testStartKillRestartStop() async throws {
        let reference = try Fixture.reference()
        let configuration = try Fixture.configuration(restart: .init(maxRestarts: 3, window: 600, delay: 0.2))
        let server = EdgespecServer(configuration: configuration)
        let states = StateLog()
        server.onStateChange = { states.append($0) }
        XCTAssertEqual(server.state, .stopped)
        XCTAssertThrowsError(try server.client())

        let url: URL
        do {
            url = try await server.start()
        } catch {
            return XCTFail("start failed: \(error)\n\(server.recentLog)")
        }
        XCTAssertEqual(url.host, "127.0.0.1")
        XCTAssertNotEqual(url.port, 0)
        XCTAssertEqual(server.state, .running(url))
        XCTAssertTrue(server.apiKey.hasPrefix("es-") && server.apiKey.count > 32, "a random key")
        let client = try server.client(retryPolicy: .none, timeout: 120)
        let health = try await client.health()
        XCTAssertEqual(health.model, reference.model_id)
        let anonymous = EdgespecClient(baseURL: url, retryPolicy: .none)
        guard case .unauthorized? = await caught({ try await anonymous.models() }) as? EdgespecError else {
            return XCTFail("the random key is required")
        }
        let same = try await server.start()
        XCTAssertEqual(same, url, "start() on a running server returns its URL")

        // Kill it; the manager notices and starts a new one.
        let first = try XCTUnwrap(server.processIdentifier)
        XCTAssertEqual(kill(first, SIGKILL), 0)
        try await eventually("the manager sees the kill") { server.lastExit == .init(status: SIGKILL, signalled: true) }
        try await eventually(timeout: 300, "a new server process after the kill") {
            if case .running = server.state, let pid = server.processIdentifier, pid != first { return true }
            if case .failed(let why) = server.state { XCTFail("failed: \(why)\n\(server.recentLog)"); return true }
            return false
        }
        XCTAssertEqual(server.restartCount, 1)
        let second = try XCTUnwrap(server.processIdentifier)
        XCTAssertNotEqual(kill(first, 0), 0, "the killed process is gone")
        let restarted = try server.client(retryPolicy: .none, timeout: 120)
        let reply = try await restarted.chat(ChatRequest(messages: reference.messages,
                                                         options: .init(maxTokens: reference.chat.max_tokens)))
        XCTAssertEqual(reply.text, reference.chat.text)
        if restarted.baseURL == url {
            let old = try await client.health()
            XCTAssertEqual(old.status, "ok", "clients holding the old URL keep working")
        }
        try await eventually("observers are told of the restart") { states.all.contains(.restarting) }

        // Stop: the process exits and the port no longer answers.
        await server.stop()
        XCTAssertEqual(server.state, .stopped)
        XCTAssertNil(server.processIdentifier)
        XCTAssertEqual(server.restartCount, 1, "a stop is not a death")
        // stop() sends SIGTERM, and the server shuts down by itself (uvicorn re-raises the
        // signal once it is done), well before the SIGKILL that would follow a hang.
        let clean: [EdgespecServer.Exit] = [.init(status: 0, signalled: false), .init(status: SIGTERM, signalled: true)]
        XCTAssertTrue(clean.contains(server.lastExit ?? .init(status: -1, signalled: false)), "\(String(describing: server.lastExit))")
        try await eventually("the stopped process is gone") { kill(second, 0) != 0 }
        guard case .connection? = await caught({ try await restarted.health() }) as? EdgespecError else {
            return XCTFail("a stopped server still answers")
        }
        try await eventually("observers are told it stopped") { states.all.last == .stopped }

        // And it can be started again.
        let again = try await server.start()
        let fresh = try await server.client().health()
        XCTAssertEqual(fresh.status, "ok")
        XCTAssertEqual(server.state, .running(again))
        server.stopNow()
        XCTAssertEqual(server.state, .stopped)
    }

    func testRestartBudgetEndsInFailed() async throws {
        let configuration = try Fixture.configuration(restart: .never)
        let server = EdgespecServer(configuration: configuration)
        try await server.start()
        let pid = try XCTUnwrap(server.processIdentifier)
        kill(pid, SIGKILL)
        try await eventually("failed after a death with no restarts allowed") {
            if case .failed = server.state { return true }
            return false
        }
        XCTAssertEqual(server.restartCount, 0)
        XCTAssertNil(server.processIdentifier)
        await server.stop()
        XCTAssertEqual(server.state, .stopped)
    }

    func testAMissingLauncherFails() async throws {
        let server = EdgespecServer(configuration: .edgespec("/nonexistent/edgespec"))
        let error = await caught { try await server.start() }
        XCTAssertEqual(error as? EdgespecServer.ServerError, .launcherNotFound("/nonexistent/edgespec"))
        guard case .failed = server.state else { return XCTFail("\(server.state)") }
    }

    func testAServerThatCannotStartReportsWhy() async throws {
        var configuration = try Fixture.configuration()
        configuration.model = "/nonexistent/bundle"
        let server = EdgespecServer(configuration: configuration)
        let error = await caught { try await server.start() }
        guard case .exitedDuringStartup(let status, let log)? = error as? EdgespecServer.ServerError else {
            return XCTFail("\(String(describing: error))")
        }
        XCTAssertNotEqual(status, 0)
        XCTAssertFalse(log.isEmpty, "stderr is kept for the error")
        XCTAssertNil(server.processIdentifier)
    }
}

final class StateLog: @unchecked Sendable {
    private let lock = NSLock()
    private var states: [EdgespecServer.State] = []
    func append(_ s: EdgespecServer.State) { lock.lock(); states.append(s); lock.unlock() }
    var all: [EdgespecServer.State] { lock.lock(); defer { lock.unlock() }; return states }
}
