import Foundation
import XCTest
@testable import EdgespecKit
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// What `make test` passes to the Swift tests (see the Makefile's `swift-test` target):
///   EDGESPEC_TEST_PYTHON     the venv's python (runs `python -m edgespec.cli serve`)
///   EDGESPEC_TEST_FIXTURE    the folder `tests/swift_fixture.py` wrote: tiny-test/ and reference.json
///   EDGESPEC_TEST_PRELOAD    optional LD_PRELOAD for the server (Debian's OpenBLAS)
/// Without them the tests that need a live server are skipped; the rest run.
enum Fixture {
    struct Reference: Decodable {
        struct Chat: Decodable {
            let max_tokens: Int
            let text: String
            let finish_reason: String
            let prompt_tokens: Int
            let completion_tokens: Int
        }

        struct Completion: Decodable {
            let prompt: String
            let max_tokens: Int
            let text: String
            let prompt_tokens: Int
            let prompt_ids: [Int]
        }

        struct Seeded: Decodable {
            let max_tokens: Int
            let temperature: Double
            let top_p: Double
            let seed: UInt64
            let text: String
        }

        struct Stop: Decodable {
            let max_tokens: Int
            let stop: String
            let text: String
        }

        /// On the tiny-json bundle (JSON punctuation, a template that renders tools).
        struct Structured: Decodable {
            let bundle: String
            let schema: JSONValue
            let tool: JSONValue
            let max_tokens: Int
            let schema_text: String
            let call_name: String
            let call_arguments: String
            let call_id: String
            let answer_max_tokens: Int
            let answer_text: String
            let answer_prompt_tokens: Int
        }

        let bundle: String
        let model_id: String
        let messages: [ChatMessage]
        let chat: Chat
        let completion: Completion
        let seeded: Seeded
        let stop: Stop
        let structured: Structured
    }

    static let environment = ProcessInfo.processInfo.environment

    static func reference() throws -> Reference {
        guard let python = environment["EDGESPEC_TEST_PYTHON"], !python.isEmpty,
              let folder = environment["EDGESPEC_TEST_FIXTURE"], !folder.isEmpty
        else {
            throw XCTSkip("needs a live edgespec server: run `make swift-test` (sets EDGESPEC_TEST_PYTHON and EDGESPEC_TEST_FIXTURE)")
        }
        _ = python
        let data = try Data(contentsOf: URL(fileURLWithPath: folder).appendingPathComponent("reference.json"))
        return try JSONDecoder().decode(Reference.self, from: data)
    }

    /// `python -m edgespec.cli serve --model <tiny bundle> ...` with the given key and options.
    static func configuration(apiKey: String? = nil, extra: [String] = [], model: String? = nil,
                              restart: EdgespecServer.RestartPolicy = .init()) throws -> EdgespecServer.Configuration
    {
        let reference = try reference()
        var configuration = EdgespecServer.Configuration.python(environment["EDGESPEC_TEST_PYTHON"]!,
                                                                model: model ?? reference.bundle)
        configuration.apiKey = apiKey
        configuration.extraArguments = extra
        configuration.startupTimeout = 300
        configuration.restartPolicy = restart
        if let preload = environment["EDGESPEC_TEST_PRELOAD"], FileManager.default.fileExists(atPath: preload) {
            configuration.environment["LD_PRELOAD"] = preload
        }
        return configuration
    }

    /// Servers shared by the tests of this process (started on first use, stopped at exit).
    private static let lock = NSLock()
    nonisolated(unsafe) private static var servers: [String: EdgespecServer] = [:]

    static func sharedServer(_ name: String, apiKey: String? = nil, extra: [String] = [],
                             model: String? = nil) async throws -> EdgespecServer {
        let server: EdgespecServer = try {
            lock.lock()
            defer { lock.unlock() }
            if let s = servers[name] { return s }
            let s = EdgespecServer(configuration: try configuration(apiKey: apiKey, extra: extra, model: model))
            servers[name] = s
            if servers.count == 1 { atexit { Fixture.stopAll() } }
            return s
        }()
        do {
            try await server.start()
        } catch {
            XCTFail("edgespec serve did not start: \(error)\n\(server.recentLog)")
            throw error
        }
        return server
    }

    static func stopAll() {
        lock.lock()
        let all = Array(servers.values)
        servers = [:]
        lock.unlock()
        for s in all { s.stopNow() }
    }
}

/// Polls `condition` until it holds; fails after `timeout` (generous: no timing is asserted).
func eventually(timeout: TimeInterval = 60, _ what: String, file: StaticString = #filePath, line: UInt = #line,
                _ condition: () async throws -> Bool) async throws
{
    let deadline = Date().addingTimeInterval(timeout)
    while Date() < deadline {
        if try await condition() { return }
        try await Task.sleep(nanoseconds: 50_000_000)
    }
    XCTFail("timed out waiting for: \(what)", file: file, line: line)
    throw EdgespecError.connection("timed out waiting for: \(what)")
}

/// The error a throwing async call threw, or nil.
func caught<T>(_ body: () async throws -> T) async -> Error? {
    do {
        _ = try await body()
        return nil
    } catch {
        return error
    }
}
