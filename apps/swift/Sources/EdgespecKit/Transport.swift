import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif

/// What a request delivers: the response head first, then the body in pieces as they
/// arrive.
enum TransportEvent: Sendable {
    case response(HTTPURLResponse)
    case data(Data)
}

/// One HTTP request whose response is read as it arrives, through a
/// `URLSessionDataDelegate`. This works everywhere, FoundationNetworking on Linux
/// included, where `URLSession.bytes(for:)` does not exist.
///
/// Ending the returned stream early (its consumer is cancelled or drops it) cancels the
/// data task, which closes the connection: the server sees the client leave.
enum Transport {
    static func open(_ request: URLRequest, timeout: TimeInterval) -> AsyncThrowingStream<TransportEvent, Error> {
        AsyncThrowingStream { continuation in
            let configuration = URLSessionConfiguration.ephemeral
            configuration.timeoutIntervalForRequest = timeout  // longest silence, e.g. waiting in the queue
            configuration.timeoutIntervalForResource = 7 * 24 * 3600
            configuration.requestCachePolicy = .reloadIgnoringLocalCacheData
            configuration.urlCache = nil
            let delegate = Receiver(continuation)
            // The session keeps its delegate until it is invalidated, below.
            let session = URLSession(configuration: configuration, delegate: delegate, delegateQueue: nil)
            let task = session.dataTask(with: request)
            continuation.onTermination = { _ in
                task.cancel()
                session.invalidateAndCancel()
            }
            task.resume()
        }
    }

    /// Reads what is left of a body (an error answer, a whole JSON reply).
    static func collect(_ events: inout AsyncThrowingStream<TransportEvent, Error>.AsyncIterator) async throws -> Data {
        var body = Data()
        while let event = try await events.next() {
            if case .data(let piece) = event { body.append(piece) }
        }
        return body
    }

    private final class Receiver: NSObject, URLSessionDataDelegate, @unchecked Sendable {
        // Only touched from the session's serial delegate queue.
        private let continuation: AsyncThrowingStream<TransportEvent, Error>.Continuation

        init(_ continuation: AsyncThrowingStream<TransportEvent, Error>.Continuation) {
            self.continuation = continuation
        }

        func urlSession(_ session: URLSession, dataTask: URLSessionDataTask, didReceive response: URLResponse,
                        completionHandler: @escaping (URLSession.ResponseDisposition) -> Void)
        {
            guard let http = response as? HTTPURLResponse else {
                continuation.finish(throwing: EdgespecError.connection("not an HTTP response"))
                completionHandler(.cancel)
                return
            }
            continuation.yield(.response(http))
            completionHandler(.allow)
        }

        func urlSession(_ session: URLSession, dataTask: URLSessionDataTask, didReceive data: Data) {
            continuation.yield(.data(data))
        }

        func urlSession(_ session: URLSession, task: URLSessionTask, didCompleteWithError error: Error?) {
            guard let error else {
                continuation.finish()
                return
            }
            if let urlError = error as? URLError, urlError.code == .cancelled {
                continuation.finish(throwing: CancellationError())
            } else {
                continuation.finish(throwing: EdgespecError.connection(Self.describe(error)))
            }
        }

        private static func describe(_ error: Error) -> String {
            if let urlError = error as? URLError {
                return "\(urlError.localizedDescription) (URLError \(urlError.code.rawValue))"
            }
            return error.localizedDescription
        }
    }
}
